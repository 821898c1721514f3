"""attn_implementation="attnscale" after ``import attnscale`` alone, and tiny random Llama, Gemma 2
(softcap and a sliding window) and gpt-oss (sinks) models under torch.compile(fullgraph=True)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch._dynamo

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'attnscale[hf]')")

import attnscale  # noqa: E402
from attnscale import kernels  # noqa: E402

NO_KERNEL = kernels.build_precondition()
# Max |diff| of the compiled logits (values up to ~0.8) against eager attnscale, measured: 1.8e-7
# (Llama), 2.4e-7 (Gemma 2), 2.1e-7 (gpt-oss).
LOGITS_ATOL = 1e-4


def tiny(arch: str) -> torch.nn.Module:
    common = dict(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256,
    )  # fmt: skip
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
    elif arch == "gemma2":
        config = transformers.Gemma2Config(
            **common, head_dim=16, sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=16
        )
    else:
        config = transformers.GptOssConfig(**common, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="attnscale").eval()
    if arch == "gpt-oss":
        for layer in model.model.layers:
            layer.self_attn.sinks.data.normal_(0.0, 2.0)
    return model


IDS = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(1))  # longer than the windows


@pytest.mark.skipif(NO_KERNEL is not None, reason=f"the compiled kernel cannot be had here: {NO_KERNEL}")
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt-oss"])
def test_compiled_models_have_one_graph_and_the_eager_logits(arch):
    model = tiny(arch)
    assert model.config._attn_implementation == "attnscale"

    def logits(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids).logits

    with torch.no_grad():
        eager = logits(IDS)
        if arch != "llama":  # softcap, window or sinks: attnscale's own kernel, not torch's
            assert attnscale.last_backend() == "fused"
        torch._dynamo.reset()
        explained = torch._dynamo.explain(logits)(IDS)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        torch._dynamo.reset()
        compiled = torch.compile(logits, fullgraph=True, backend="aot_eager")(IDS)
    assert (compiled - eager).abs().max().item() < LOGITS_ATOL


def test_import_attnscale_alone_registers_the_implementation_for_generate_and_packed_sequences():
    """In a fresh process, before and after transformers is imported: no register() call."""
    code = textwrap.dedent(
        """
        import sys
        first = sys.argv[1]
        if first == "attnscale":
            import attnscale
            assert "transformers" not in sys.modules  # importing attnscale imports no transformers
        import torch, transformers
        import attnscale
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="attnscale").eval()
        ids = torch.randint(0, 128, (1, 6))
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
        model.set_attn_implementation("eager")
        assert torch.equal(tokens, model.generate(ids, max_new_tokens=4, do_sample=False))
        model.set_attn_implementation("attnscale")
        batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
        with torch.no_grad():
            model(**batch)
        print(model.config._attn_implementation, attnscale.last_backend())
        """
    )
    for first in ("attnscale", "transformers"):
        done = subprocess.run([sys.executable, "-c", code, first], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        implementation, backend = done.stdout.split()
        # The packed call: varlen, in one kernel call, or without the kernel one call per sequence,
        # which for the last (plain causal) sequence is torch's SDPA.
        assert implementation == "attnscale" and backend == ("fused" if NO_KERNEL is None else "torch")


@pytest.mark.parametrize("before", ["find_spec", "finder_ahead"])
def test_registration_survives_a_probe_of_transformers_and_an_import_hook_ahead_of_it(before):
    """Two ways the one-shot registration got lost, in a fresh process each: a plain
    ``importlib.util.find_spec("transformers.modeling_utils")`` before the real import used it up,
    and a meta-path finder put ahead of attnscale's (as typeguard's and jaxtyping's import hooks
    are) loaded transformers without consulting it. Either way transformers then said "attnscale"
    is not supported."""
    code = textwrap.dedent(
        """
        import sys, importlib.abc, importlib.util
        import attnscale
        if sys.argv[1] == "find_spec":
            assert importlib.util.find_spec("transformers.modeling_utils") is not None
        else:
            class Ahead(importlib.abc.MetaPathFinder):
                def find_spec(self, fullname, path, target=None):  # loads every module itself
                    for finder in sys.meta_path:
                        if finder is self or type(finder).__name__ == "_AfterImport":
                            continue
                        spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
                        if spec is not None:
                            return spec
                    return None
            sys.meta_path.insert(0, Ahead())
        import transformers
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=4, max_position_embeddings=32)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="attnscale")
        print(model.config._attn_implementation)
        """
    )
    done = subprocess.run([sys.executable, "-c", code, before], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["attnscale"]
