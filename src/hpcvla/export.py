"""`hpcvla export`: a run's newest checkpoint (or one named) as a policy folder, in the
layout of the published folder it started from or in hpcvla's own (`export_policy`)."""

from __future__ import annotations

from pathlib import Path

from hpcvla.checkpoint import store
from hpcvla.evaluate import checkpoint_weights, run_config


def export_policy(cfg, run_dir: Path, out: Path, layout: str = "auto",
                  checkpoint: Path | None = None) -> dict:
    """The newest checkpoint (or `checkpoint`) of the run `cfg` configured, as a policy
    folder, LoRA adapters merged into the weights (policies/lora.py). `layout`: "published",
    the layout of the published folder the run started from (policy.pretrained), which the
    reference's own loader reads (policies/export.py: the RL heads left out); "hpcvla", the folder
    `policy.pretrained` and `policies.load_pretrained` read, RL heads kept
    (policies.save_pretrained); "auto": published for a run from a published folder.
    Returns its version, merged layers, folder, layout and a line saying so."""
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    from hpcvla.policies import save_pretrained
    from hpcvla.policies.export import is_published, save_like
    from hpcvla.policies.lora import merge_lora
    from hpcvla.preflight import unwritable
    from hpcvla.weight_checks import pretrained_problems
    why = unwritable(out)
    if why:
        raise ValueError(f"{out}: a folder to write the policy in ({why})")
    held = sorted(p.name for p in Path(out).iterdir()) if Path(out).is_dir() else []
    if held:  # files left there would be read beside the export's (an index wins over them)
        raise ValueError(f"{out}: a new or empty folder to write the policy in (it holds "
                         f"{', '.join(held[:4])}{', ...' if len(held) > 4 else ''}); choose "
                         "another, or empty it")
    source = cfg.policy.pretrained
    moved = pretrained_problems(cfg.policy, cfg.env) if source else []
    if moved:  # the folder the run was built from: gone, or not what it was
        name, value, valid = moved[0]
        raise ValueError(f"{name} = {value!r} (the folder the run was built from): expected "
                         f"{valid}; where it moved, edit {name} in {run_config(run_dir)}")
    if layout == "auto":
        layout = "published" if source and is_published(source) else "hpcvla"
    if layout == "published" and not (source and is_published(source)):
        raise ValueError("--format published: the run started from " + (
            f"{source}, a folder in hpcvla's own layout" if source else
            "no pretrained folder (policy.pretrained unset)") + "; export it with --format "
            "hpcvla")
    policy = build_policy(cfg, env_spec(cfg.env))
    weights, state = checkpoint_weights(checkpoint or run_dir)
    store.check_fit(weights, policy.state_dict(), checkpoint or run_dir)
    policy.load_arrays(weights)
    del weights  # at full size a second copy of the policy: written files need the room
    merged = merge_lora(policy) if cfg.policy.lora_rank else 0
    if layout == "published":
        written = save_like(policy, source, out)
        layout = (f"the layout of {source}: {written['from_policy']} tensors trained, "
                  f"{written['from_source']} kept from it, {written['rl_heads_left_out']} "
                  "RL-head tensors left out")
    else:
        save_pretrained(policy, out)
        layout = "hpcvla's layout"
    summary = (f"policy version {state['version']} written to {out} ({layout})"
               + (f"; {merged} LoRA layers merged" if merged else ""))
    return {"version": state["version"], "merged_lora_layers": merged, "folder": str(out),
            "layout": layout, "summary": summary}
