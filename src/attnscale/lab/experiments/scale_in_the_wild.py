"""scale-in-the-wild: which logit scale do the architectures in ``transformers`` really use?

Each architecture is built small from its config (random weights, nothing downloaded) with an
attention function registered in transformers' attention interface. That function receives the
query and key exactly as the model hands them to attention (after RoPE and QK-norm), runs the
model's own eager attention to get its softmax weights, and fits the effective scale from them
with :func:`attnscale.diagnostics.fit_logit_scale` - a black-box measurement that does not read
the ``scaling`` argument (which is recorded beside it as a cross-check).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ...diagnostics import diagnose_scale, fit_logit_scale
from ..base import Claim, Headline, Judgement, Profile, Progress, RuleVersion, Verdict, save_figure

CLAIM = Claim(
    id="scale-in-the-wild",
    statement=(
        (
        "Modern transformers divide attention logits by sqrt(head_dim); Llama 3 70B, for example, has "
        "head_dim 8192 / 64 = 128 and divides by sqrt(128) ~ 11.3."
    )
    ),
    sources=(
        "Vaswani et al. 2017, sec. 3.2.1 and footnote 4",
        "Llama Team 2024 (The Llama 3 Herd of Models), Table 3",
        "model configs and attention code of the installed transformers",
    ),
    method=(
        "Build each architecture small from its transformers config (1 layer, random weights), "
        "route its attention through a probe that calls the model's own eager attention and fits "
        "s in log p = s * q.k + c per head from the weights it returns; compare s with 1/sqrt(head_dim), "
        "head_dim being the query's last dim as the model passes it to attention. Released "
        "scale-relevant config values are kept where they depart from the default "
        "(Gemma 2 27B, Granite 3, DeepSeek-V3 with YaRN)."
    ),
    rule=(
        "An architecture conforms when s * sqrt(head_dim) is within 3% of 1 and the fit's R^2 > 0.99. "
        "inconclusive if transformers is missing or fewer than 5 architectures could be probed; "
        "holds if every architecture tried was probed and conforms; holds-approximately if at least two thirds "
        "of the probed ones conform; does-not-hold otherwise. Every architecture that could not be probed is "
        "counted and named in the verdict's reason."
    ),
    rule_history=(
        RuleVersion(1, "2026-11-29", "the rule as first committed", "b558f8a9abbe6909"),
        RuleVersion(
            2,
            "2026-12-01",
            "architectures that cannot be probed are counted and named in the reason, and holds needs every "
            "architecture tried to be probed",
            "8ae3c360aa0d6d8c",
        ),
        RuleVersion(3, "2026-12-02", "the fingerprint now also covers the measurement (run, the lab code it calls, every profile's Config), so that a change to what is measured needs a new version; the rule is unchanged", "f60d8a59fbd73898"),
    ),
)

HEADLINE = Headline("conforming_share", "share of probed architectures that divide by sqrt(head_dim)")

_SMALL = dict(vocab_size=128, hidden_size=256, num_hidden_layers=1, num_attention_heads=4, intermediate_size=256, num_key_value_heads=2)

# (label, model_type, config overrides, why the scale departs where it does: documented facts)
ARCHITECTURES: tuple[tuple[str, str, dict, str], ...] = (
    ("Llama", "llama", {}, ""),
    ("Mistral", "mistral", {}, ""),
    ("Mixtral", "mixtral", {}, ""),
    ("Qwen2", "qwen2", {}, ""),
    ("Qwen3", "qwen3", {}, "QK-norm (RMSNorm on q and k) before the 1/sqrt(head_dim) scale"),
    ("Qwen3-MoE", "qwen3_moe", {}, ""),
    ("Gemma", "gemma", {}, ""),
    ("Gemma 2", "gemma2", {}, "query_pre_attn_scalar = head_dim by default; logits soft-capped at 50"),
    (
        "Gemma 2 27B scalar",
        "gemma2",
        {"head_dim": 128, "query_pre_attn_scalar": 144},
        "Gemma 2 27B divides by sqrt(query_pre_attn_scalar) = sqrt(144) = sqrt(d_model / num_heads), not sqrt(head_dim = 128)",
    ),
    ("Gemma 3", "gemma3_text", {}, "QK-norm; scale from query_pre_attn_scalar (= head_dim here)"),
    ("Phi-3", "phi3", {"pad_token_id": 0}, ""),
    ("Phi", "phi", {}, ""),
    ("GPT-2", "gpt2", {}, ""),
    ("GPT-NeoX", "gpt_neox", {}, ""),
    ("BERT", "bert", {}, ""),
    ("T5", "t5", {}, "T5 uses no scale: 1/sqrt(d_k) is folded into the initialisation of the query weights"),
    ("OLMo", "olmo", {}, ""),
    ("OLMo 2", "olmo2", {}, "QK-norm over the full projection, then 1/sqrt(head_dim)"),
    ("StarCoder2", "starcoder2", {}, ""),
    ("Cohere", "cohere", {}, ""),
    ("StableLM", "stablelm", {}, ""),
    ("GLM", "glm", {"pad_token_id": 0}, ""),
    (
        "Granite 3",
        "granite",
        {"head_dim": 128, "attention_multiplier": 0.0078125},
        "Granite 3.x ships attention_multiplier = 0.0078125 = 1/head_dim: muP's 1/d scaling",
    ),
    ("DeepSeek-V3", "deepseek_v3", {"num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64}, "multi-head latent attention: head_dim = 128 (no RoPE) + 64 (RoPE)"),
    (
        "DeepSeek-V3 YaRN",
        "deepseek_v3",
        {
            "num_key_value_heads": 4,
            "q_lora_rank": 64,
            "kv_lora_rank": 64,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 40.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "rope_theta": 10000.0,
            },
        },
        "YaRN context extension multiplies the scale by mscale^2, mscale = 0.1 ln(40) + 1 = 1.369",
    ),
    ("Falcon", "falcon", {}, ""),
    ("BLOOM", "bloom", {}, "ALiBi"),
    ("MPT", "mpt", {}, "ALiBi"),
)


@dataclass(frozen=True)
class Config:
    architectures: tuple[str, ...]
    batch: int = 2
    length: int = 16

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile == "tiny":
            return cls(architectures=("Llama", "T5", "Granite 3"), length=8)
        return cls(architectures=tuple(label for label, *_ in ARCHITECTURES))


def _probe_architecture(transformers, model_type: str, overrides: dict, batch: int, length: int) -> dict:
    calls: list[dict] = []

    def probe(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        eager = sys.modules[type(module).__module__].eager_attention_forward
        out, weights = eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        fit = fit_logit_scale(query, key, weights)
        calls.append(
            {
                "head_dim": query.shape[-1],
                "num_heads": query.shape[-3],
                "scale": fit.mean_scale,
                "r2": fit.min_r2,
                "scaling_argument": None if scaling is None else float(scaling),
                "softcap": kwargs.get("softcap"),
            }
        )
        return out, weights

    transformers.AttentionInterface.register("attnscale_probe", probe)
    config = transformers.AutoConfig.for_model(model_type)
    for name, value in {**_SMALL, **overrides}.items():
        setattr(config, name, value)
    model = transformers.AutoModel.from_config(config, attn_implementation="attnscale_probe").eval()
    for name, param in model.named_parameters():
        if "relative_attention_bias" in name:  # T5: keep logits = q.k so the slope is the scale
            torch.nn.init.zeros_(param)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, _SMALL["vocab_size"] - 1, (batch, length), generator=gen)
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            model(input_ids=ids, decoder_input_ids=ids)
        else:
            model(input_ids=ids)
    if not calls:
        raise RuntimeError("attention does not go through transformers' attention interface")
    first = calls[0]
    return {
        "head_dim": first["head_dim"],
        "scale": sum(c["scale"] for c in calls) / len(calls),
        "r2": min(c["r2"] for c in calls),
        "scaling_argument": first["scaling_argument"],
        "softcap": first["softcap"],
        "attention_calls": len(calls),
    }


def _split_bloom(fused: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, L, _ = fused.shape
    qkv = fused.view(B, L, heads, 3, -1)  # (B, L, H, 3, D): BloomAttention._reshape's layout
    return qkv[..., 0, :].transpose(1, 2), qkv[..., 1, :].transpose(1, 2)  # (B, H, L, D) each


def _split_mpt(fused: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, L, _ = fused.shape
    q, k, _ = fused.chunk(3, dim=2)  # MptAttention's layout: [q | k | v], each (B, L, H * D)
    return q.reshape(B, L, heads, -1).transpose(1, 2), k.reshape(B, L, heads, -1).transpose(1, 2)


# Architectures with attention code of their own (not transformers' attention interface): the fused
# q/k/v projection of their first layer and how it splits into query and key (B, H, L, D), or None
# where the query and key are read after RoPE, from the module's apply_rotary_pos_emb.
_OWN_ATTENTION: dict[str, tuple[str, Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]] | None] = {
    "falcon": None,
    "bloom": ("h.0.self_attention.query_key_value", _split_bloom),
    "mpt": ("blocks.0.attn.Wqkv", _split_mpt),
}


def _probe_own_attention(transformers, model_type: str, overrides: dict, batch: int, length: int) -> dict:
    """Probe a model whose attention is its own code: read q and k where the model computes them and
    the weights from ``output_attentions``, with ALiBi zeroed so that the logits are s * q.k (ALiBi adds
    a per-key bias that the fit of s alone would mistake for noise; its order is alibi-order's claim)."""
    config = transformers.AutoConfig.for_model(model_type)
    for name, value in {**_SMALL, **overrides}.items():
        setattr(config, name, value)
    model = transformers.AutoModel.from_config(config, attn_implementation="eager").eval()
    heads = model.config.num_attention_heads
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name in ("build_alibi_tensor", "build_mpt_alibi_tensor"):
        if hasattr(model, name):
            build = getattr(model, name)
            setattr(model, name, lambda *args, build=build, **kwargs: torch.zeros_like(build(*args, **kwargs)))
    tap = _OWN_ATTENTION[model_type]
    modeling = sys.modules[type(model).__module__]
    rotary = modeling.apply_rotary_pos_emb if tap is None else None
    if tap is None:

        def rotate_and_record(q, k, *args, **kwargs):
            q, k = rotary(q, k, *args, **kwargs)
            captured.append((q, k))
            return q, k

        modeling.apply_rotary_pos_emb = rotate_and_record
        handle = None
    else:
        path, split = tap
        handle = model.get_submodule(path).register_forward_hook(lambda mod, args, out: captured.append(split(out, heads)))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, _SMALL["vocab_size"] - 1, (batch, length), generator=gen)
    try:
        with torch.no_grad():
            # an explicit mask: without one BLOOM builds ALiBi inline, past build_alibi_tensor
            attentions = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True).attentions
    finally:
        if handle is not None:
            handle.remove()
        if rotary is not None:
            modeling.apply_rotary_pos_emb = rotary
    if not captured or not attentions:
        raise RuntimeError(f"{model_type}: no query/key or attention weights were captured")
    query, key = captured[0]
    fit = fit_logit_scale(query, key, attentions[0])
    return {
        "head_dim": query.shape[-1],
        "scale": fit.mean_scale,
        "r2": fit.min_r2,
        "scaling_argument": None,
        "softcap": None,
        "attention_calls": len(captured),
    }


def run(config: Config, seed: int, progress: Progress) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        return {"transformers": None, "rows": [], "not_probed": [], "conforming_share": None, "llama_head_dim_128_divisor": None}
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    rows, not_probed = [], []
    table = {label: (model_type, overrides, note) for label, model_type, overrides, note in ARCHITECTURES}
    for i, label in enumerate(config.architectures):
        model_type, overrides, note = table[label]
        try:
            probe = _probe_own_attention if model_type in _OWN_ATTENTION else _probe_architecture
            found = probe(transformers, model_type, overrides, config.batch, config.length)
        except Exception as exc:  # an architecture that cannot be built or routed is reported, not fatal
            not_probed.append({"architecture": label, "model_type": model_type, "reason": f"{type(exc).__name__}: {exc}"[:160]})
        else:
            ratio = found["scale"] * math.sqrt(found["head_dim"])
            rows.append(
                {
                    "architecture": label,
                    "model_type": model_type,
                    **found,
                    "divisor": 1.0 / found["scale"],
                    "scale_times_sqrt_head_dim": ratio,
                    "diagnosis": diagnose_scale(found["scale"], found["head_dim"]),
                    "conforms": abs(ratio - 1.0) <= 0.03 and found["r2"] > 0.99,
                    "note": note,
                }
            )
        progress(i + 1, len(config.architectures))
    llama = next((r for r in rows if r["architecture"] == "Llama"), None)
    return {
        "transformers": transformers.__version__,
        "rows": rows,
        "not_probed": not_probed,
        "conforming_share": sum(r["conforms"] for r in rows) / len(rows) if rows else None,
        "llama_head_dim_128_divisor": llama["divisor"] if llama and llama["head_dim"] == 128 else None,
    }


def judge(measured: dict) -> Judgement:
    rows = measured.get("rows", [])
    if measured.get("transformers") is None:
        return Judgement(Verdict.INCONCLUSIVE, "transformers is not installed (pip install 'attnscale[hf]')")
    failed = measured.get("not_probed", [])
    tried = len(rows) + len(failed)
    unprobed = (
        f"; {len(failed)} of {tried} could not be probed: " + ", ".join(f"{f['architecture']} ({f['reason']})" for f in failed)
        if failed
        else ""
    )
    if len(rows) < 5:
        return Judgement(Verdict.INCONCLUSIVE, f"only {len(rows)} of {tried} architectures could be probed (need 5){unprobed}")
    departing = [r["architecture"] for r in rows if not r["conforms"]]
    share = 1 - len(departing) / len(rows)
    if not departing and not failed:
        return Judgement(Verdict.HOLDS, f"all {len(rows)} architectures tried use 1/sqrt(head_dim)")
    summary = (
        f"{len(rows) - len(departing)} of {len(rows)} probed use 1/sqrt(head_dim); "
        f"departing: {', '.join(departing) or 'none'}{unprobed}"
    )
    if share >= 2 / 3:
        return Judgement(Verdict.HOLDS_APPROXIMATELY, summary)
    return Judgement(Verdict.DOES_NOT_HOLD, summary)


def plot(measured: dict, outdir: Path) -> list[str]:
    from matplotlib.figure import Figure

    rows = measured.get("rows", [])
    failed = [f["architecture"] for f in measured.get("not_probed", [])]
    if not rows:
        return []
    # 0.2 in a row: 28 architectures stay within the page's 560 px height without shrinking the text below 7 pt
    fig = Figure(figsize=(7.5, 0.2 * (len(rows) + len(failed)) + 1.4), layout="constrained")
    ax = fig.subplots()
    labels = [r["architecture"] for r in rows]
    ratios = [r["scale_times_sqrt_head_dim"] for r in rows]
    colors = ["tab:green" if r["conforms"] else "tab:red" for r in rows]
    ax.barh(labels, ratios, color=colors)
    for name in failed:  # an architecture that could not be probed keeps its row, marked
        ax.barh(name, 1.0, color="none", edgecolor="grey", hatch="//")
        ax.text(1.05, name, "not probed", va="center", fontsize=9, color="grey")
    ax.axvline(1.0, color="black", lw=1, ls="--")
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("measured scale x sqrt(head_dim)   (1 = divides by sqrt(head_dim))")
    ax.set_title("Effective attention scale of transformers architectures (probed)")
    return [save_figure(fig, outdir, "scale_in_the_wild")]


def captions(measured: dict) -> dict[str, str]:
    rows = measured.get("rows", [])
    if not rows:
        return {}
    conforming = sum(1 for r in rows if r["conforms"])
    failed = len(measured.get("not_probed", []))
    return {
        "scale_in_the_wild": (
            "The attention scale measured in each architecture of the transformers library, times sqrt(head_dim), "
            "on a log axis: a bar that ends on the dashed line divides by sqrt(head_dim). Green bars conform, red "
            "ones do not "
            f"({conforming} of {len(rows)} probed conform); the {failed} hatched rows could not be probed."
        )
    }
