"""What the flow family reads of published π0/π0.5 folders (LeRobot's and openpi's, and this
project's own; policies/folders.py loads them): the names their tensors have, the sizes and
sampler a checkpoint fixes, the processor of its prompt and statistics, and whether it can act
in the configured env. Mixed into FlowPolicy.

HF key map: names follow LeRobot's π0 (the openpi port), so a converted π0 checkpoint's tensors
map by name; the sizes, the padded action and state dims, the horizon and the sampler's steps
come from the checkpoint (`checkpoint_kwargs`). The RL heads have their own `rl.` names.
"""

from __future__ import annotations

from hpcvla.policies.paligemma import PI0_PREFIX as _PI0
from hpcvla.policies.paligemma import paligemma_size

OPENPI_SAMPLE_STEPS = 10  # openpi's sample_actions(num_steps=10): its folders do not record it


class PublishedFlowFolders:
    """The flow family's published-folder plumbing (module docstring)."""

    variant: str
    model_state_dim: int
    model_action_dim: int

    HF_KEY_MAP = (  # transformers 5 dropped SiglipVisionModel's `vision_model.` level; files keep it
        ("prefix.vision_tower.", _PI0 + "paligemma.model.vision_tower.vision_model."),
        ("prefix.", _PI0 + "paligemma.model."),
        ("gemma_expert.", _PI0 + "gemma_expert.model."),
        ("value_head.", "rl.value_head."),
        ("log_std", "rl.log_std"),
        # DSRL's noise actor, its critics and temperature: RL-only, fresh on a π0 folder
        ("noise_", "rl.noise_"), ("value_q", "rl.value_q"), ("sac_log_alpha", "rl.sac_log_alpha"),
        ("", "model."),  # *_proj; π0's action_time_mlp_*, π0.5's time_mlp_*
    )
    HF_LAYOUT = {  # published π0 folders (policies/folders.py)
        "root": "model.",  # openpi's converted PyTorch files leave it out
        "tied": ((_PI0 + "paligemma.model.language_model.embed_tokens.weight",
                  _PI0 + "paligemma.lm_head.weight"),),  # hub files keep only lm_head
        "unused": (_PI0 + "gemma_expert.lm_head.weight",),  # the expert outputs no tokens
    }

    @classmethod
    def folder_problems(cls, folder, policy_cfg, env_cfg) -> list[tuple[str, str, str]]:
        """A published π0/π0.5 folder's config problems: its tokenizer and statistics
        (processor.check_folder), and the sizes the loader reads from its tensors' shapes."""
        from hpcvla.policies.folders import checkpoint_kwargs
        from hpcvla.policies.processor import check_folder
        problems = check_folder(folder, policy_cfg.tokenizer)
        try:
            checkpoint_kwargs(cls, folder)
        except (ValueError, KeyError) as err:
            problems.append(("policy.pretrained", folder, f"a {cls.family} checkpoint whose "
                             f"sizes the loader can read: {err}"))
        return problems

    @classmethod
    def env_fit_problems(cls, folder, spec_of) -> list[str]:
        """A published π0/π0.5 folder against the env's state and action dims
        (processor.dims_problems): the dims it was trained on inside its padded ones."""
        from hpcvla.policies.folders import checkpoint_kwargs
        from hpcvla.policies.processor import dims_problems, trained_dims
        padded = checkpoint_kwargs(cls, folder)["model_dims"]
        spec = spec_of()
        return dims_problems(folder, trained_dims(folder, padded), spec.state_dim,
                             spec.action_dim)

    def make_processor(self, folder, tokenizer_folder, spec, delta_action_dims: int = -1):
        """A LeRobot or openpi folder's processor (processor.CheckpointProcessor); the model's
        padded widths tell openpi's padded statistics apart."""
        from hpcvla.policies.processor import CheckpointProcessor
        return CheckpointProcessor.from_folder(
            folder, tokenizer_folder, self.variant, spec.vocab,
            spec.state_dim, spec.action_dim,
            {"state_dim": self.model_state_dim, "action_dim": self.model_action_dim},
            delta_action_dims)

    @classmethod
    def checkpoint_kwargs(cls, shapes: dict, config: dict) -> dict:
        """What a checkpoint fixes (HF names -> shapes, and its config.json): the variant
        (π0.5 has `time_mlp_*`), padded dims from its projections, the horizon from its
        config (ours, LeRobot's `chunk_size` or openpi's `action_horizon`; else the env's),
        and the sampler's steps (ours, LeRobot's `num_inference_steps`, openpi's default),
        which policy.denoise_steps > 0 overrides."""
        dims = {"action_dim": shapes["model.action_in_proj.weight"][1]}
        if "model.state_proj.weight" in shapes:
            dims["state_dim"] = shapes["model.state_proj.weight"][1]
        horizon = config.get("kwargs", {}).get("model_dims", {}).get("horizon") or \
            config.get("chunk_size") or config.get("action_horizon")  # LeRobot, openpi
        size = config.get("kwargs", {}).get("size")  # ours: the resolved configs
        steps = config.get("kwargs", {}).get("denoise_steps") or \
            config.get("num_inference_steps") or \
            (OPENPI_SAMPLE_STEPS if "paligemma_variant" in config else None)  # LeRobot, openpi
        return {"model_dims": dict(dims, horizon=horizon) if horizon else dims,
                "variant": "pi05" if "model.time_mlp_in.weight" in shapes else "pi0",
                "size": size if isinstance(size, dict) else paligemma_size(shapes),
                **({"denoise_steps": int(steps)} if steps else {})}


__all__ = ["OPENPI_SAMPLE_STEPS", "PublishedFlowFolders"]
