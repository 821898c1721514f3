"""Attention implementations with the bugs practitioners ship, and correct ones, for the checks."""

import math
import threading

import torch
import torch.nn.functional as F

import attnscale


def _expand(k, q):
    return k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)


def _weights(q, k, divisor, attn_mask=None, is_causal=False, enable_gqa=False, fill=float("-inf")):
    k = _expand(k, q)
    s = q @ k.transpose(-1, -2) / divisor
    if is_causal:
        s = s.masked_fill(~attnscale.causal_mask(q.shape[-2], k.shape[-2]), fill)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, fill)
    return torch.softmax(s, dim=-1)


def correct(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    """Plain and right: float32 softmax, empty rows to zero."""
    w = _weights(q.float(), k.float(), math.sqrt(q.shape[-1]), attn_mask, is_causal).nan_to_num(0.0)
    return (w @ _expand(v, q).float()).to(q.dtype)


def sqrt_d_model(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    return _weights(q, k, math.sqrt(q.shape[-1] * q.shape[-3]), attn_mask, is_causal) @ _expand(v, q)


def double_scale(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    return F.scaled_dot_product_attention(q / math.sqrt(q.shape[-1]), k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)


def no_scale(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    return _weights(q, k, 1.0, attn_mask, is_causal) @ _expand(v, q)


def missing_v(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    return _weights(q, k, math.sqrt(q.shape[-1]), attn_mask, is_causal)


def wrong_softmax_axis(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    s = q @ _expand(k, q).transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s, dim=-2) @ _expand(v, q)


def inverted_mask(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None if attn_mask is None else ~attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)


def big_negative_mask_fp16(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    """The classic -1e9 fill, computed in the input dtype: overflows fp16, uniform on empty rows."""
    return _weights(q, k, math.sqrt(q.shape[-1]), attn_mask, is_causal, fill=-1e9) @ _expand(v, q)


def interleaved_gqa(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    rep = q.shape[-3] // k.shape[-3]
    k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)


# Broken targets: `attnscale check` must diagnose each of them in one line per check, never crash or hang.
HANG = threading.Event()
"""Set by a test to release the calls of ``hangs`` that are still waiting."""


def raises(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    raise RuntimeError("kernel exploded")


def other_signature(x):
    return x


def returns_none(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    return None


def returns_tuple(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)
    return out, None


def returns_3x3_zeros(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    return torch.zeros(3, 3)


def returns_zeros(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    """The right shape and dtype, and no attention at all."""
    return q.new_zeros(*q.shape[:-1], v.shape[-1])


def returns_float32(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    return correct(q, k, v, attn_mask, is_causal, enable_gqa).float()


def returns_nan(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    return correct(q, k, v, attn_mask, is_causal, enable_gqa) * float("nan")


def hangs(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    HANG.wait(30)
    return correct(q, k, v, attn_mask, is_causal, enable_gqa)


no_projections = torch.nn.Linear(8, 8)
not_callable = 42


class BrokenAttention(torch.nn.Module):
    """The projections of an attention layer around a forward that is broken as ``mode`` says."""

    def __init__(self, mode):
        super().__init__()
        self.num_heads = 2
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (torch.nn.Linear(8, 8) for _ in range(4))
        self.mode = mode

    def forward(self, x):
        if self.mode == "raises":
            raise RuntimeError("forward exploded")
        if self.mode == "hangs":
            HANG.wait(30)
        return None


module_raises = BrokenAttention("raises")
module_returns_none = BrokenAttention("returns None")
module_hangs = BrokenAttention("hangs")
