"""Diagnostics: probes that find the logit scale an attention implementation really uses."""

from .conformance import CheckResult, ConformanceReport, check_attention
from .probe import ModuleProbe, ScaleFit, diagnose_scale, fit_logit_scale, probe_attention, probe_module

__all__ = [
    "CheckResult",
    "ConformanceReport",
    "ModuleProbe",
    "ScaleFit",
    "check_attention",
    "diagnose_scale",
    "fit_logit_scale",
    "probe_attention",
    "probe_module",
]
