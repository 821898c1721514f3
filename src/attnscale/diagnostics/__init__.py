"""Diagnostics: probes that find the logit scale an attention implementation really uses, and a
monitor that watches attention in live models (``attnscale.diagnostics.hf`` needs transformers)."""

from .conformance import CheckResult, ConformanceReport, check_attention
# The function is attnscale.monitor; here the name stays the submodule's.
from .monitor import Flag, HeadReport, LayerSummary, Monitor, MonitorReport, MonitorThresholds
from .probe import ModuleProbe, ScaleFit, diagnose_scale, fit_logit_scale, probe_attention, probe_module

__all__ = [
    "CheckResult",
    "ConformanceReport",
    "Flag",
    "HeadReport",
    "LayerSummary",
    "ModuleProbe",
    "Monitor",
    "MonitorReport",
    "MonitorThresholds",
    "ScaleFit",
    "check_attention",
    "diagnose_scale",
    "fit_logit_scale",
    "probe_attention",
    "probe_module",
]
