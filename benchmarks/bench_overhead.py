"""What one attention call costs beyond its kernel: tiny CPU calls (a decoding step: B 1, H 8, L 1,
S 64, D 64, float32; plain, GQA and softcap also in bfloat16 and float16), where the kernel's own work is a few microseconds, for every feature, a
step over 1024 keys (what reading them costs beside torch's kernel), and a step over a growing
cache (every call a new signature), attnscale against torch's SDPA in the same process.

Each round times every case's attnscale call and its torch baseline back to back (``--calls`` calls
each, after a twentieth as many untimed ones, so that neither side is timed on the caches the
previous case left; each side first in every other round), rounds interleaved; a case's figures are the median over rounds of
each side's time per call and of the round's difference (or ratio) of the two, which the verdict reads, at torch's default
thread count and at one thread; all of it in each of ``--processes`` fresh interpreters, a case's
figures and verdict the median over them (where the tensors and the code lie in memory moves a 1-2 ms
call's difference between processes by more than the target). Targets: a call torch's SDPA computes (plain,
causal, masks, GQA, torch's own module) at most torch's time + 10 us, the step over 1024 keys against
torch's kernel followed by one read of its keys (``READ``: the NaN rule reads them, and a reference row
times it against torch's kernel alone); a feature torch lacks at most
2x torch's plain call; HuggingFace ``generate`` on a tiny Llama with ``attn_implementation=
"attnscale"`` at least 0.95x the tokens per second of ``"sdpa"``. Every output is checked once
against torch's or the float64 reference before it is timed.

Both sides of a case read the same weights: the HuggingFace layer and ``generate`` run one model,
its attention implementation switched between them, and the module's q, k, v projections are views
of torch's module's packed ``in_proj`` (its ``out_proj`` the same parameters). Two copies of the
same weights lie apart in memory and in the caches, which moves a 1-2 ms call by more than the
10 us target: the reference row "a second copy of the model" times exactly that.

    python benchmarks/bench_overhead.py                       # every case, both thread counts, 5 processes
    python benchmarks/bench_overhead.py --processes 1         # one process (about a fifth of the time)
    python benchmarks/bench_overhead.py --json benchmarks/recorded/overhead.json
    python benchmarks/bench_overhead.py --markdown benchmarks/recorded/overhead.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import attnscale
from attnscale import reference
from machine import DEFAULT_THREADS, describe

SCHEMA = "attnscale.bench_overhead/7"  # /2: generate's ratio is the median of the rounds' ratios; /3: both sides on the same weights, varlen with new lengths; /4: see PAIRED; /5: see PROCESSES; /6: see READ; /7: see SIXTEEN
PAIRED = (
    "a case's verdict reads the median of its rounds' paired figures (attnscale's time minus torch's, or their ratio, "
    "each round's two timed back to back), where /3 read the difference (ratio) of the two sides' medians over the "
    "rounds: those carried the host's drift between samples taken a round apart, which moved a 1-2 ms call's "
    "difference by more than the 10 us target (as /2 did for generate's ratio)"
)
PROCESSES = (
    "a case's figures are the median over --processes fresh interpreters of each one's /4 figures, and its verdict "
    "reads that median, where /4 read one process: between processes of one commit, where the tensors and the "
    "code lie in memory differs, the 1-2 ms cases' paired differences moved by more than the 10 us target (the "
    "module's forward at 2 threads over four processes of a52d3c3: +23.0, +16.3, +5.2 and -0.5 us; "
    "benchmarks/recorded/overhead_process_a52d3c3_*.json), so one process's verdict on them was a draw"
)
READ = (
    "the step over 1024 keys is held to torch's + 10 us against torch's kernel followed by one read of its keys (k.sum(), a "
    "reduction over every entry), and its comparison with torch's kernel alone, the /4 and /5 row, is "
    "kept as a reference row: the NaN rule must read every key (an inf key whose products with the query are -inf gets "
    "weight 0 and leaves the row finite, so only a read of k finds it), a check that protects a user stays, and + 10 us "
    "is a target for what a call costs, not for a read of 2 MiB; under /5 the row missed at both thread counts "
    "(+ 26.3 / + 57.9 us, benchmarks/recorded/overhead_29d514a.json), and this rule was written after those figures "
    "were seen"
)
SIXTEEN = (
    "rows of bfloat16 and float16 decoding steps are added (plain and GQA, which torch computes, held to torch's + 10 us "
    "in their dtype; softcap, a feature torch lacks, held to 2x torch's plain call in its dtype), the targets unchanged: "
    "a 16-bit call torch computes is remembered as a float32 one is since 9c9f008, and no row measured 16-bit calls "
    "before; the rows and their baselines were chosen before any of them was timed here"
)
TORCH_SLACK_US = 10.0  # a call torch computes: at most torch's time + this
FEATURE_RATIO = 2.0  # a feature torch lacks: at most this times torch's plain call
GENERATE_RATIO = 0.95  # HF generate: at least this share of "sdpa"'s tokens per second
B, H, HKV, L, S, D = 1, 8, 2, 1, 64, 64
LONG = 1024  # the keys of the one case whose kernel work is not negligible (from /4)
TORCH_SDPA = torch._C._nn.scaled_dot_product_attention


@dataclass(frozen=True)
class Case:
    """One call: attnscale's, its torch baseline (None: compared with torch's plain call), and what
    attnscale's output must equal (computed once, before timing)."""

    name: str
    ours: Callable[[], object]
    theirs: Callable[[], object] | None
    want: Callable[[], torch.Tensor]
    atol: float = 1e-5
    reference: bool = False
    """A row that locates a cost beside the attention (no target: its "met" is None)."""
    plain: Callable[[], object] | None = None
    """torch's plain call a feature (``theirs`` None) is held against: None for the float32 one (SIXTEEN)."""


def _first(result: object) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result  # type: ignore[index,return-value]


def _with_grad(call: Callable[[], torch.Tensor]) -> torch.Tensor:
    with torch.enable_grad():
        return call().detach()


def _fp64(q, k, v, **options) -> torch.Tensor:
    numpy = {name: (x.detach().double().numpy() if isinstance(x, torch.Tensor) else x) for name, x in options.items()}
    return torch.from_numpy(reference.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), **numpy)).float()


def cases() -> list[Case]:
    gen = torch.Generator().manual_seed(0)
    draw = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k, v = draw(B, H, L, D), draw(B, H, S, D), draw(B, H, S, D)
    kg, vg = draw(B, HKV, S, D), draw(B, HKV, S, D)
    kl, vl = draw(B, H, LONG, D), draw(B, H, LONG, D)  # a decoding step over a longer cache: 2 MiB of keys
    keep = torch.rand(B, 1, L, S, generator=gen) > 0.2
    keep[..., 0] = True
    add = torch.zeros(B, 1, L, S).masked_fill(~keep, float("-inf"))
    slopes = attnscale.alibi_slopes(H)
    learned = slopes.clone().requires_grad_()
    sinks = draw(H)
    sdpa = attnscale.scaled_dot_product_attention
    found = [
        Case("plain", lambda: sdpa(q, k, v), lambda: TORCH_SDPA(q, k, v), lambda: TORCH_SDPA(q, k, v)),
        Case("causal (top-left)", lambda: sdpa(q, k, v, is_causal=True), lambda: TORCH_SDPA(q, k, v, is_causal=True), lambda: TORCH_SDPA(q, k, v, is_causal=True)),
        Case("bool mask", lambda: sdpa(q, k, v, keep), lambda: TORCH_SDPA(q, k, v, keep), lambda: TORCH_SDPA(q, k, v, keep)),
        Case("float mask", lambda: sdpa(q, k, v, add), lambda: TORCH_SDPA(q, k, v, add), lambda: TORCH_SDPA(q, k, v, add)),
        Case("GQA (enable_gqa)", lambda: sdpa(q, kg, vg, enable_gqa=True), lambda: TORCH_SDPA(q, kg, vg, enable_gqa=True), lambda: TORCH_SDPA(q, kg, vg, enable_gqa=True)),
        Case(f"plain, {LONG} keys (torch: its kernel, then one read of the keys)", lambda: sdpa(q, kl, vl), lambda: (TORCH_SDPA(q, kl, vl), kl.sum())[0],
             lambda: TORCH_SDPA(q, kl, vl)),  # fmt: skip (READ)
        Case(f"plain, {LONG} keys", lambda: sdpa(q, kl, vl), lambda: TORCH_SDPA(q, kl, vl), lambda: TORCH_SDPA(q, kl, vl), reference=True),  # (READ)
        Case("causal, bottom-right", lambda: sdpa(q, k, v, is_causal=True, causal_alignment="bottom_right"), None, lambda: _fp64(q, k, v, is_causal=True, causal_alignment="bottom_right")),
        Case("window (16, 0), bottom-right", lambda: sdpa(q, k, v, is_causal=True, causal_alignment="bottom_right", window=(16, 0)), None,
             lambda: _fp64(q, k, v, is_causal=True, causal_alignment="bottom_right", window=(16, 0))),
        Case("softcap 30", lambda: sdpa(q, k, v, softcap=30.0), None, lambda: _fp64(q, k, v, softcap=30.0)),
        Case("ALiBi", lambda: sdpa(q, k, v, alibi_slopes=slopes), None, lambda: _fp64(q, k, v, alibi_slopes=slopes)),
        # learned slopes matter where their gradient is wanted: timed with grad enabled (no backward)
        Case("ALiBi, learned slopes (grad enabled)", lambda: _with_grad(lambda: sdpa(q, k, v, alibi_slopes=learned)), None, lambda: _fp64(q, k, v, alibi_slopes=learned)),
        Case("sinks", lambda: sdpa(q, k, v, sinks=sinks), None, lambda: _fp64(q, k, v, sinks=sinks)),
        Case("return_stats", lambda: _first(sdpa(q, k, v, return_stats=True)), None, lambda: TORCH_SDPA(q, k, v)),
    ]
    found += _sixteen_bit_cases(q, k, v, kg, vg)
    # a decoding step over a growing cache: every call a new key length (what HuggingFace generate
    # makes), GQA as in Llama; 600 lengths in turn, each side the same (more than the 512 signatures
    # attnscale's validation remembers: no length is met again as a validated one; its remembered
    # call of torch's kernel takes keys of any length as one signature)
    grown = [(draw(B, HKV, n, D), draw(B, HKV, n, D)) for n in range(S, S + 600)]
    turn = {"ours": 0, "theirs": 0}

    def growing(side: str, call: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            kk, vv = grown[turn[side] % len(grown)]
            turn[side] += 1
            return call(q, kk, vv, enable_gqa=True)

        return step

    found.append(Case("GQA, a new key length each call (a growing cache)", growing("ours", sdpa), growing("theirs", TORCH_SDPA),
                      lambda: TORCH_SDPA(q, *grown[(turn["ours"] - 1) % len(grown)], enable_gqa=True)))  # fmt: skip (the step ours just took)
    # varlen: 4 sequences, one query each (a batch of decoding steps of different lengths)
    lengths = [16, 24, 8, 16]
    cu_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_q = torch.arange(0, 5, dtype=torch.int32)
    pq, pk, pv = draw(4, H, D), draw(sum(lengths), H, D), draw(sum(lengths), H, D)

    def packed_want() -> torch.Tensor:
        rows = [TORCH_SDPA(pq[i : i + 1].transpose(0, 1)[None], pk[a:b].transpose(0, 1)[None], pv[a:b].transpose(0, 1)[None])[0].transpose(0, 1)
                for i, (a, b) in enumerate(zip(cu_k[:-1].tolist(), cu_k[1:].tolist()))]  # fmt: skip
        return torch.cat(rows)

    found.append(Case("varlen, 4 sequences", lambda: attnscale.varlen_attention(pq, pk, pv, cu_q, cu_k, is_causal=True), None, packed_want))
    found.append(_new_lengths_case(pq, pk, pv, cu_q))
    # the module's forward against torch's own module, same width and heads, one new token
    torch.manual_seed(0)
    ours_module = attnscale.MultiHeadAttention(D * H, num_heads=H).eval()
    theirs_module = torch.nn.MultiheadAttention(D * H, H, batch_first=True).eval()
    E = D * H
    for i, projection in enumerate((ours_module.q_proj, ours_module.k_proj, ours_module.v_proj)):  # views of torch's packed in_proj: the same weights
        projection.weight = torch.nn.Parameter(theirs_module.in_proj_weight.detach()[i * E : (i + 1) * E])
        projection.bias = torch.nn.Parameter(theirs_module.in_proj_bias.detach()[i * E : (i + 1) * E])
    ours_module.out_proj.weight, ours_module.out_proj.bias = theirs_module.out_proj.weight, theirs_module.out_proj.bias
    x = draw(B, S, D * H)
    found.append(
        Case("the module's forward (MultiHeadAttention, 512 wide, 8 heads, 64 tokens)", lambda: ours_module(x), lambda: theirs_module(x, x, x, need_weights=False)[0],
             lambda: theirs_module(x, x, x, need_weights=False)[0], atol=1e-4)  # fmt: skip
    )
    # where the module's time goes: the ops it runs (one packed q, k, v projection, torch's SDPA, the
    # output projection), called by hand from Python, against torch's module's one C++ op
    found.append(
        Case("the module's ops by hand (packed in_proj, torch's SDPA, out_proj; torch: its module)",
             lambda: _module_by_hand(x, theirs_module, H), lambda: theirs_module(x, x, x, need_weights=False)[0],
             lambda: theirs_module(x, x, x, need_weights=False)[0], atol=1e-4, reference=True)  # fmt: skip
    )
    # the same with attnscale's SDPA: what its checks of k and of the output rows (the NaN rule) cost in the module's place
    found.append(
        Case("the module's ops by hand with attnscale's SDPA (torch: its module)",
             lambda: _module_by_hand(x, theirs_module, H, attnscale.scaled_dot_product_attention), lambda: theirs_module(x, x, x, need_weights=False)[0],
             lambda: theirs_module(x, x, x, need_weights=False)[0], atol=1e-4, reference=True)  # fmt: skip
    )
    found += _hf_layer_cases()
    return found


def _module_by_hand(x: torch.Tensor, module: torch.nn.MultiheadAttention, heads: int, sdpa=TORCH_SDPA) -> torch.Tensor:
    """torch's module's output from its weights by three ops called from Python: the packed
    projection, ``sdpa`` (torch's) on its q, k, v views, the output projection."""
    qkv = F.linear(x, module.in_proj_weight, module.in_proj_bias).unflatten(-1, (3 * heads, -1)).transpose(1, 2)  # (B, 3 H, L, D)
    out = sdpa(qkv[:, :heads], qkv[:, heads : 2 * heads], qkv[:, 2 * heads :])  # (B, H, L, D)
    return F.linear(out.transpose(1, 2).flatten(-2), module.out_proj.weight, module.out_proj.bias)


def _sixteen_bit_cases(q, k, v, kg, vg) -> list[Case]:
    """The decoding step in bfloat16 and float16 (SIXTEEN): plain and GQA against the same torch
    call, softcap against torch's plain call in that dtype (its output within one unit of the
    dtype at 1 of the float64 answer rounded to the dtype: outputs below 1)."""
    sdpa, found = attnscale.scaled_dot_product_attention, []
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
        q16, k16, v16, kg16, vg16 = (t.to(dtype) for t in (q, k, v, kg, vg))
        plain16 = lambda q16=q16, k16=k16, v16=v16: TORCH_SDPA(q16, k16, v16)  # noqa: E731
        gqa16 = lambda q16=q16, kg16=kg16, vg16=vg16: TORCH_SDPA(q16, kg16, vg16, enable_gqa=True)  # noqa: E731
        found += [
            Case(f"plain, {name}", lambda q16=q16, k16=k16, v16=v16: sdpa(q16, k16, v16), plain16, plain16),
            Case(f"GQA (enable_gqa), {name}", lambda q16=q16, kg16=kg16, vg16=vg16: sdpa(q16, kg16, vg16, enable_gqa=True), gqa16, gqa16),
            Case(f"softcap 30, {name}", lambda q16=q16, k16=k16, v16=v16: sdpa(q16, k16, v16, softcap=30.0), None,
                 lambda q16=q16, k16=k16, v16=v16, dtype=dtype: _fp64(q16, k16, v16, softcap=30.0).to(dtype), atol=torch.finfo(dtype).eps, plain=plain16),
        ]  # fmt: skip
    return found


def _new_lengths_case(pq: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, cu_q: torch.Tensor) -> Case:
    """varlen with the 4 sequences' key lengths new each call (a batch of decoding steps, each
    sequence at its own length): 600 splits of the same 64 keys in turn, each side the same."""
    splits = sorted({(a, b - a, c - b, S - c) for a, b, c in itertools.combinations(range(1, S), 3)})
    chosen = [splits[i] for i in torch.randperm(len(splits), generator=torch.Generator().manual_seed(3))[:600].tolist()]
    cus = [torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32) for lengths in chosen]
    turn = [0]

    def step() -> torch.Tensor:
        turn[0] += 1
        return attnscale.varlen_attention(pq, pk, pv, cu_q, cus[turn[0] % len(cus)], is_causal=True)

    def want() -> torch.Tensor:  # the split ours just took
        cu_k = cus[turn[0] % len(cus)].tolist()
        return torch.cat([TORCH_SDPA(pq[i : i + 1].transpose(0, 1)[None], pk[a:b].transpose(0, 1)[None], pv[a:b].transpose(0, 1)[None])[0].transpose(0, 1)
                          for i, (a, b) in enumerate(zip(cu_k[:-1], cu_k[1:]))])  # fmt: skip

    return Case("varlen, 4 sequences, new lengths each call", step, None, want)


def _tiny_llama(implementation: str):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=H * D, intermediate_size=2 * H * D, num_hidden_layers=2, num_attention_heads=H, num_key_value_heads=HKV,
        max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=implementation).eval()


def _hf_layer_cases() -> list[Case]:
    """One attention layer of a tiny Llama through attn_implementation="attnscale" against "sdpa",
    one model switched between them; and, for reference, "sdpa" on a second copy of the model
    against the first (what two copies of the same weights cost apart)."""
    model, copy = _tiny_llama("sdpa"), _tiny_llama("sdpa")
    x = torch.randn(B, S, H * D, generator=torch.Generator().manual_seed(1))
    position_ids = torch.arange(S)[None]
    rotary = model.model.rotary_emb(x, position_ids)

    def run(on, implementation: str) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            on.config._attn_implementation = implementation  # (read by every attention layer's forward; both sides set it)
            return on.model.layers[0].self_attn(x, position_embeddings=rotary, attention_mask=None)[0]

        return call

    ours, theirs = run(model, "attnscale"), run(model, "sdpa")
    return [
        Case("a HuggingFace Llama layer (attnscale vs sdpa)", ours, theirs, theirs, atol=1e-5),
        Case("a HuggingFace Llama layer: sdpa on a second copy of the model (vs the first)", run(copy, "sdpa"), theirs, theirs, atol=1e-5, reference=True),
    ]


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(max(1, calls // 20)):  # untimed: the caches as the call itself leaves them, not as the previous case did
        fn()
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls / 1e3


def time_cases(found: Sequence[Case], threads: int, rounds: int, calls: int) -> list[dict]:
    torch.set_num_threads(threads)
    plain = found[0].theirs
    assert plain is not None
    samples: dict[str, tuple[list[float], list[float]]] = {c.name: ([], []) for c in found}
    with torch.no_grad():
        for case in found:  # warm-up, and the output checked
            got = case.ours()
            torch.testing.assert_close(_first(got), case.want(), rtol=0, atol=case.atol, msg=case.name)
            (case.theirs or case.plain or plain)()
        for round_ in range(rounds):
            for case in found:
                ours, theirs = samples[case.name]
                baseline = case.theirs or case.plain or plain
                if round_ % 2:  # each side first in every other round
                    theirs.append(_per_call_us(baseline, calls))
                    ours.append(_per_call_us(case.ours, calls))
                else:
                    ours.append(_per_call_us(case.ours, calls))
                    theirs.append(_per_call_us(baseline, calls))
    rows = []
    for case in found:
        ours_samples, theirs_samples = samples[case.name]
        ours, theirs = statistics.median(ours_samples), statistics.median(theirs_samples)
        difference = statistics.median(a - b for a, b in zip(ours_samples, theirs_samples))  # (PAIRED)
        ratio = statistics.median(a / b for a, b in zip(ours_samples, theirs_samples))
        against = "torch" if case.theirs is not None else "torch plain"
        met = None if case.reference else _met(against, difference, ratio)
        with torch.no_grad():
            case.ours()
        rows.append({
            "case": case.name, "threads": threads, "attnscale_us": ours, "torch_us": theirs, "difference_us": difference, "ratio": ratio,
            "against": against, "met": met, "backend": None if case.reference else attnscale.last_backend(),
        })  # fmt: skip
    return rows


def _met(against: str, difference_us: float, ratio: float) -> bool:
    """The target of a case: at most torch's time + TORCH_SLACK_US against the same torch call, at
    most FEATURE_RATIO times torch's plain call for a feature torch lacks."""
    return difference_us <= TORCH_SLACK_US if against == "torch" else ratio <= FEATURE_RATIO


def time_generate(threads: int, rounds: int, new_tokens: int) -> dict:
    """Greedy decoding of ``new_tokens`` from an 8-token prompt, tokens per second of each
    implementation (median over rounds, interleaved, each first in every other round) and the
    ratio, the median over rounds of each round's ratio (the two runs of a round, back to back,
    share the host's state, where the ratio of the two medians moved by the host's drift between
    runs); the two must produce the same tokens."""
    torch.set_num_threads(threads)
    model = _tiny_llama("sdpa")  # one model, its attention switched: both sides read the same weights
    prompt = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    names = ("attnscale", "sdpa")
    outputs, rates = {}, {name: [] for name in names}
    for round_ in range(rounds + 1):  # the first round warms up
        for name in sorted(names, reverse=bool(round_ % 2)):  # each side first in every other round
            model.set_attn_implementation(name)
            start = time.perf_counter()
            with torch.no_grad():
                outputs[name] = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            rates[name].append(new_tokens / (time.perf_counter() - start))
    assert torch.equal(outputs["attnscale"], outputs["sdpa"]), "attnscale and sdpa decoded different tokens"
    ours, theirs = (statistics.median(rates[name][1:]) for name in ("attnscale", "sdpa"))
    ratio = statistics.median(a / b for a, b in zip(rates["attnscale"][1:], rates["sdpa"][1:]))
    return {"threads": threads, "attnscale_tokens_per_s": ours, "sdpa_tokens_per_s": theirs, "ratio": ratio, "met": ratio >= GENERATE_RATIO}


def markdown(result: dict) -> str:
    """docs/performance.md's table of a ``--json`` run."""
    paired = "difference_us" in result["cases"][0]  # (/4 on: each verdict reads the rounds' paired figures, PAIRED)
    processes = result.get("processes", 1)  # (/5: figures and verdicts the median over processes, PROCESSES)
    over = f" in each of {processes} processes, and the median over the processes" if processes > 1 else ""
    lines = [
        f"`python benchmarks/bench_overhead.py --rounds {result['rounds']} --calls {result['calls']}"
        + (f" --processes {processes}" if "processes" in result else "")
        + f"` on {result['cpu']}, torch {result['torch']}, commit {result['commit']}: microseconds per call (median of {result['rounds']} rounds "
        f"of {result['calls']} calls, interleaved{over}); target: a call torch computes at most torch's + {TORCH_SLACK_US:g} us, a feature torch "
        f"lacks at most {FEATURE_RATIO:g}x torch's plain call"
        + (" (each read from the median over rounds of a round's difference or ratio, the two sides timed back to back)." if paired else "."),
        "",
        "| case | threads | attnscale | torch | " + ("paired | " if paired else "") + ("each process | " if processes > 1 else "") + "against | backend | target |",
        "|---|---|---|---|---|---|---|" + ("---|" if paired else "") + ("---|" if processes > 1 else ""),
    ]
    for row in result["cases"]:
        plain = row["against"] == "torch plain"
        pair = (f"{row['ratio']:.2f}x | " if plain else f"{row['difference_us']:+.1f} | ") if paired else ""
        each = ", ".join(f"{x:.2f}x" if plain else f"{x:+.1f}" for x in row["per_process"]) + " | " if processes > 1 else ""
        lines.append(
            f"| {row['case']} | {row['threads']} | {row['attnscale_us']:.1f} | {row['torch_us']:.1f} | {pair}{each}{row['against']} | {row['backend'] or '-'} | {'reference' if row['met'] is None else 'met' if row['met'] else 'MISSED'} |"
        )
    lines.append("")
    how = " (medians); the median of the rounds' ratios" if result["schema"] != "attnscale.bench_overhead/1" else ""  # (/1: the ratio of the two medians)
    for row in result["generate"]:
        each = f" (each process: {', '.join(f'{x:.2f}x' for x in row['per_process'])})" if processes > 1 else ""
        lines.append(
            f"- HF generate, tiny Llama, {row['threads']} thread(s): attnscale {row['attnscale_tokens_per_s']:.0f} tokens/s, sdpa {row['sdpa_tokens_per_s']:.0f}"
            f"{how}: {row['ratio']:.2f}x{each} ({'met' if row['met'] else 'MISSED'}, target {GENERATE_RATIO:g}x)"
        )
    return "\n".join(lines)


def in_one_process(args: argparse.Namespace, threads: Sequence[int]) -> dict:
    """Every case and ``generate`` at each thread count, in this process."""
    found = cases()
    result = {"schema": SCHEMA, **describe(), "rounds": args.rounds, "calls": args.calls, "processes": 1, "cases": [], "generate": []}
    for count in threads:
        result["cases"] += time_cases(found, count, args.rounds, args.calls)
        result["generate"].append(time_generate(count, args.rounds, args.new_tokens))  # (a generate is some 0.1 s: as many rounds as the calls')
    return result


def in_processes(args: argparse.Namespace, threads: Sequence[int]) -> dict:
    """:func:`in_one_process` in each of ``args.processes`` fresh interpreters, one after another,
    combined by :func:`combined` (PROCESSES)."""
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for index in range(args.processes):
            print(f"bench_overhead: process {index + 1} of {args.processes} ...", file=sys.stderr, flush=True)
            path = os.path.join(folder, f"{index}.json")
            command = [
                sys.executable, os.path.abspath(__file__), "--processes", "1", "--rounds", str(args.rounds), "--calls", str(args.calls),
                "--new-tokens", str(args.new_tokens), "--threads", *map(str, threads), "--json", path,
            ]  # fmt: skip
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            with open(path) as handle:
                runs.append(json.load(handle))
    return combined(runs)


def combined(runs: Sequence[dict]) -> dict:
    """One result from several processes' (:func:`in_one_process`): each figure the median over
    them, each process's paired figure kept (``per_process``), the verdicts read from the medians."""
    result = {**runs[0], "processes": len(runs), "cases": [], "generate": []}
    for rows in zip(*(run["cases"] for run in runs)):
        row = dict(rows[0])
        assert all((r["case"], r["threads"], r["backend"]) == (row["case"], row["threads"], row["backend"]) for r in rows), "processes ran different cases"
        for field in ("attnscale_us", "torch_us", "difference_us", "ratio"):
            row[field] = statistics.median(r[field] for r in rows)
        row["per_process"] = [r["ratio"] if row["against"] == "torch plain" else r["difference_us"] for r in rows]
        row["met"] = None if row["met"] is None else _met(row["against"], row["difference_us"], row["ratio"])
        result["cases"].append(row)
    for rows in zip(*(run["generate"] for run in runs)):
        row = dict(rows[0])
        for field in ("attnscale_tokens_per_s", "sdpa_tokens_per_s", "ratio"):
            row[field] = statistics.median(r[field] for r in rows)
        row["per_process"] = [r["ratio"] for r in rows]
        row["met"] = row["ratio"] >= GENERATE_RATIO
        result["generate"].append(row)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="thread counts (default: torch's default and 1)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens each HF generate decodes (default 32)")
    parser.add_argument("--json", metavar="PATH", help="also write the run as JSON")
    parser.add_argument("--processes", type=int, default=5, help="fresh interpreters that each run every case; figures and verdicts are the median over them (default 5)")
    parser.add_argument("--markdown", metavar="JSON", help="print the docs' table from a --json file and exit")
    args = parser.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as handle:
            print(markdown(json.load(handle)))
        return 0
    if args.processes < 1:
        parser.error(f"--processes: expected at least 1, got {args.processes}")
    threads = args.threads or sorted({DEFAULT_THREADS, 1}, reverse=True)
    result = in_one_process(args, threads) if args.processes == 1 else in_processes(args, threads)
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
