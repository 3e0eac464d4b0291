"""`hpcvla plan --auto` on GPU nodes: which layouts of the search fit the GPUs (the memory
model, hpcvla/memory/; the settings the search turns where none does at the config's:
memory/levers.py). docs/memory.md."""

from __future__ import annotations

from hpcvla.config.loader import with_overrides
from hpcvla.envs import env_spec
from hpcvla.memory.footprint import policy_footprint
from hpcvla.memory.layout import plan_memory
from hpcvla.memory.layout import layout_devices
from hpcvla.schedule import Layout
from hpcvla.topology.plan import plan_from_config


def configured(cfg, lay: Layout):
    """`cfg` with the settings a scale-model Layout decides."""
    return with_overrides(cfg, lay.to_overrides())


class MemoryFit:
    """Called with a Layout: None where its ranks fit their GPUs (or it puts none on a GPU),
    else what overfills one. Each layout is judged once (the search asks again of layouts it
    has seen; a judgement checks a whole config: ~25 ms), the policy's footprint measured once
    per micro-batch and inference batch the search asks about (a fake-tensor run each: seconds
    at full size), and the env's spec probed only then."""

    def __init__(self, cfg):
        self.cfg, self.spec = cfg, None
        self.footprints: dict[tuple[int, int, bool], object] = {}
        self.verdicts: dict[tuple, str | None] = {}

    def __call__(self, lay: Layout) -> str | None:
        key = (lay.world, *lay.to_overrides())  # all _judge reads of the layout
        if key not in self.verdicts:
            self.verdicts[key] = self._judge(lay)
        return self.verdicts[key]

    def _judge(self, lay: Layout) -> str | None:
        cfg = configured(self.cfg, lay)
        plan = plan_from_config(cfg.placement, lay.world)
        devices = layout_devices(cfg, plan)
        if not any(d.startswith("cuda") for d in devices.values()):
            return None
        if self.spec is None:
            self.spec = env_spec(cfg.env)
        problems = plan_memory(cfg, plan, devices, self.spec, self._footprint).problems
        return problems[0][2] if problems else None

    def _footprint(self, cfg, spec, train_obs: int, act_obs: int, on_gpus: bool):
        """policy_footprint, once per batch (the policy is the same in every layout)."""
        key = (train_obs, act_obs, on_gpus)
        if key not in self.footprints:
            self.footprints[key] = policy_footprint(cfg, spec, train_obs, act_obs, on_gpus)
        return self.footprints[key]


__all__ = ["MemoryFit", "configured"]
