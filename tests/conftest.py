"""Shared test set-up: a derandomized hypothesis profile, so every run tests the same examples."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "attnscale",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("attnscale")
