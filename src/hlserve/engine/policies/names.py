"""The scheduler's policy knobs and the names each takes, gathered from the registries the
policy modules own (``order.ORDERS``, ``mixing.MIXINGS``, ``admission.ADMISSIONS``,
``retraction.RETRACTIONS``, ``budget.BUDGET_CONTROLLERS``): what the command line's help
lists, and the one check of a config's policy names.

Why the check lives here and not in ``EngineConfig.__post_init__``: ``config.py`` sits below
``engine/`` (the engine imports it; tests/test_layout.py holds imports to flow downward), so
it cannot read the registries without listing the names a second time. Every path that
makes a config or runs one calls :func:`check_policy_names` instead:
``engine/args.py:make_config`` (the command lines, ``LLM(...)``, the simulator),
``engine/factory.py:build_engine`` (every engine, a config built by hand included) and the
vLLM plugin's options (``integrations/plugin_policy.py``)."""

from __future__ import annotations

from collections.abc import Mapping

from hlserve.config import EngineConfig
from hlserve.engine.policies.admission import ADMISSIONS
from hlserve.engine.policies.budget import BUDGET_CONTROLLERS
from hlserve.engine.policies.mixing import MIXINGS
from hlserve.engine.policies.order import ORDERS
from hlserve.engine.policies.retraction import RETRACTIONS

# EngineConfig field -> the registry of its names (checked in this order)
POLICY_REGISTRIES: dict[str, Mapping[str, object]] = {
    "mixing": MIXINGS,
    "order": ORDERS,
    "retraction": RETRACTIONS,
    "admission": ADMISSIONS,
    "budget_controller": BUDGET_CONTROLLERS,
}


def policy_names(knob: str) -> tuple[str, ...]:
    """The names a policy knob takes (an ``EngineConfig`` field of ``POLICY_REGISTRIES``)."""
    return tuple(POLICY_REGISTRIES[knob])


def check_policy_names(config: EngineConfig) -> None:
    """Raises ValueError naming the first policy knob whose name no registry holds."""
    for knob in POLICY_REGISTRIES:
        value = getattr(config, knob)
        if value not in POLICY_REGISTRIES[knob]:
            raise ValueError(f"{knob} must be one of {policy_names(knob)}, got {value!r}")
