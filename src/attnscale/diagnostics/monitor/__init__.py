"""Watch attention in a live model: per layer and head, how peaked softmax is and how large its logits get.

:func:`monitor` returns a :class:`Monitor`, a context manager (or ``start()`` / ``stop()`` for a
training loop). While it is active:

* ``torch.nn.functional.scaled_dot_product_attention`` is replaced by a wrapper with the same
  semantics that computes the call with :func:`attnscale.scaled_dot_product_attention` (statistics
  on) and returns only the output. It sees every model whose attention looks that function up at
  call time: nanoGPT-style code (``F.scaled_dot_product_attention(...)``), HuggingFace models with
  ``attn_implementation="sdpa"``, and ``torch.nn.MultiheadAttention`` called with
  ``need_weights=False`` outside its inference fast path. ``nn.MultiheadAttention`` with
  ``need_weights=True`` (its default) computes softmax itself, and its fast path (eval mode under
  ``torch.no_grad()``) runs a fused C++ kernel; neither goes through the function, so neither is seen.
* HuggingFace models set to ``attn_implementation="attnscale"`` (see :mod:`attnscale.diagnostics.hf`)
  report to the active monitor directly.
* :class:`attnscale.MultiHeadAttention` layers report their kernel call (after projections, RoPE,
  QK-Norm and the KV cache; with softcap, ALiBi, window and sinks) under the module's name.
* forward pre/post hooks on every module of ``model`` keep a stack of the modules running; a call
  is recorded under the innermost one's qualified name (``transformer.h.0.attn``). Calls made
  outside the model's forward run through torch's own function, unrecorded.

When gradients are recorded (training), the output and its gradient come from the call the model
makes without the monitor, and the statistics from a second forward pass without autograd and
without dropout: a monitored run trains exactly as an unmonitored one.

The package, one idea a file: :mod:`~attnscale.diagnostics.monitor.recording` (the monitor and
its accumulators), :mod:`~attnscale.diagnostics.monitor.report` (what it reports),
:mod:`~attnscale.diagnostics.monitor.series` (the time series and its writers) and
:mod:`~attnscale.diagnostics.monitor.alerts` (the alert rules).

Everything is restored on exit, also when the body raises. One monitor may be active at a time in
a process; starting a second one (or the same one twice) raises ``RuntimeError``.

Thread safety: the replacement of the torch function is process-wide, and so is the active
monitor. The module stack is per thread, and statistics are accumulated under a lock, so a model
may run in several threads while a monitor watches it. Start and stop the monitor while no forward
pass is running. It is meant for eager mode, not inside ``torch.compile``.

Recorded per (layer, head), accumulated over calls, batch and query rows:

* ``score_std`` and ``scaled_score_std``: standard deviation of ``q.k`` over all (query, key)
  pairs, before and after the scale. It is computed from D x D Gram matrices, never from an
  (L, S) score tensor: with ``Q`` (L, D) and ``K`` (S, D),
  ``sum_ij q_i.k_j = (sum_i q_i).(sum_j k_j)`` and ``sum_ij (q_i.k_j)^2 = <Q^T Q, K^T K>_F``.
  Masks are ignored for this statistic: every (query, key) pair counts.
* ``max_logit``: the largest logit after scale (and any additive mask) over visible keys,
  QK-Clip's S_max.
* ``entropy`` (mean, nats), ``normalized_entropy`` (mean of entropy / log(visible keys):
  1 = uniform, 0 = one-hot), ``max_prob`` (mean of each row's largest weight) and
  ``saturated_share`` (share of rows whose largest weight exceeds ``saturation_prob``).
  Rows with no visible key are left out; every other row the model computes counts, including
  the rows of padding queries (a padding mask hides keys, not queries).

Time series: with ``every=N`` only training steps 0, N, 2N, ... are recorded (the others run the
model's own attention, untouched); :meth:`Monitor.step` (or the optimizer's step, given
``optimizer=``) ends a step and turns a sampled one into a :class:`StepRecord`, which goes to
``history``, to the ``writers`` (:class:`JsonlWriter`, :class:`CsvWriter`, any callable) and to the
alert rules (:class:`AlertRules`). :func:`read_run` and :func:`plot_run` read and draw a run.

>>> import torch, attnscale
>>> from attnscale.diagnostics.monitor import AlertRules
>>> mha = attnscale.MultiHeadAttention(32, num_heads=4)
>>> opt = torch.optim.SGD(mha.parameters(), lr=0.1)
>>> mon = attnscale.monitor(mha, every=2, optimizer=opt, alerts=AlertRules(max_logit=50.0)).start()
>>> for _ in range(5):
...     mha(torch.randn(2, 6, 32)).square().mean().backward()
...     opt.step()
...     opt.zero_grad()
>>> report = mon.stop()
>>> [r.step for r in mon.history], len(mon.history[0].heads)
([0, 2, 4], 4)

The wrapper computes what torch 2.13's function computes (a row with no visible key gives zeros;
``attn_mask`` with ``is_causal`` applies both; older torch versions give NaN, or raise, there);
only dropout draws a different random pattern. Its output agrees with torch's to float32 rounding.

>>> import torch, torch.nn.functional as F, attnscale
>>> q = torch.randn(2, 4, 8, 16)  # (B, H, L, D)
>>> with attnscale.monitor(torch.nn.Identity()) as mon:
...     out = F.scaled_dot_product_attention(q, q, q)  # outside the model: not recorded
>>> mon.report().heads, F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
((), True)
"""

from .alerts import Alert, AlertRules, TrainingStopped
from .recording import HF_IMPLEMENTATIONS, ROUTE_HF, ROUTE_MHA, ROUTE_SDPA, Monitor, Writer, active_monitor, monitor, score_moments
from .report import SCHEMA, Flag, HeadReport, LayerSummary, MonitorReport, MonitorThresholds, read_csv
from .series import STATISTICS, STEP_SCHEMA, CsvWriter, JsonlWriter, StepRecord, plot_run, read_run

__all__ = [
    "HF_IMPLEMENTATIONS",
    "ROUTE_HF",
    "ROUTE_MHA",
    "ROUTE_SDPA",
    "SCHEMA",
    "STATISTICS",
    "STEP_SCHEMA",
    "Alert",
    "AlertRules",
    "CsvWriter",
    "Flag",
    "HeadReport",
    "JsonlWriter",
    "LayerSummary",
    "Monitor",
    "MonitorReport",
    "MonitorThresholds",
    "StepRecord",
    "TrainingStopped",
    "Writer",
    "active_monitor",
    "monitor",
    "plot_run",
    "read_csv",
    "read_run",
    "score_moments",
]
