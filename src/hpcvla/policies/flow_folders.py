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
        from hpcvla.policies.processor import check_folder, recipe_problems
        try:
            fixed = checkpoint_kwargs(cls, folder)
        except (ValueError, KeyError) as err:
            return check_folder(folder, policy_cfg.tokenizer, policy_cfg.asset_id) + [(
                "policy.pretrained", folder, f"a {cls.family} checkpoint whose sizes the "
                f"loader can read: {err}")]
        vocabulary = fixed["size"].get("text", {}).get("vocab_size", 0)  # the tokenizer's ids
        problems = check_folder(folder, policy_cfg.tokenizer, policy_cfg.asset_id, vocabulary)
        return problems + recipe_problems(folder, fixed["variant"], policy_cfg.delta_action_dims,
                                          policy_cfg.pi05_state, policy_cfg.asset_id)

    @classmethod
    def env_fit_problems(cls, policy_cfg, spec_of) -> list[str]:
        """A published π0/π0.5 folder against the env's state and action dims
        (processor.dims_problems): the dims it was trained on inside its padded ones."""
        from hpcvla.policies.folders import checkpoint_kwargs
        from hpcvla.policies.processor import dims_problems, trained_dims
        folder = policy_cfg.pretrained
        fixed = checkpoint_kwargs(cls, folder)
        spec = spec_of()
        trained = trained_dims(folder, fixed["model_dims"], fixed["variant"],
                               policy_cfg.pi05_state, policy_cfg.asset_id)
        return dims_problems(folder, trained, spec.state_dim, spec.action_dim)

    def make_processor(self, spec, policy_cfg):
        """A LeRobot or openpi folder's processor (processor.CheckpointProcessor); the model's
        padded widths tell openpi's padded statistics apart."""
        from hpcvla.policies.processor import CheckpointProcessor
        return CheckpointProcessor.from_folder(
            policy_cfg.pretrained, policy_cfg.tokenizer, self.variant, spec.vocab,
            spec.state_dim, spec.action_dim,
            {"state_dim": self.model_state_dim, "action_dim": self.model_action_dim},
            policy_cfg.delta_action_dims, policy_cfg.pi05_state, policy_cfg.asset_id)

    @classmethod
    def checkpoint_kwargs(cls, shapes: dict, config: dict) -> dict:
        """What a checkpoint fixes (HF names -> shapes, and its config.json): the variant
        (π0.5 has `time_mlp_*`), padded dims from its projections, the horizon from its
        config (ours, LeRobot's `chunk_size` or openpi's `action_horizon`; ours may leave it to
        the env's chunk, a published folder must say it), and the sampler's steps (ours,
        LeRobot's `num_inference_steps`, else openpi's and LeRobot's default 10),
        which policy.denoise_steps > 0 overrides."""
        kind = config.get("type")  # LeRobot's policy type
        if kind is not None and kind not in ("pi0", "pi05"):
            raise ValueError(f"config.json's type is {kind!r}: a LeRobot policy of another "
                             "kind (policy.name=flow runs LeRobot's pi0 and pi05)")
        lora = [f"{key}={config[key]!r}" for key in ("paligemma_variant", "action_expert_variant")
                if "lora" in str(config.get(key, ""))]
        if lora:  # openpi trains LoRA in JAX only, and its converter keeps the base kernels
            raise ValueError(
                f"config.json says {', '.join(lora)}: an openpi LoRA fine-tune, which openpi's "
                "converter (examples/convert_jax_model_to_pytorch.py) writes without its "
                "adapters (it copies the base kernels and loads with strict=False), so these "
                "weights are the base model's. Merge the LoRA weights into the JAX params "
                "(w + a @ b of every adapted kernel) before converting; if this folder's are "
                "merged already, name the variants without `_lora` in its config.json")
        if any(".paligemma.language_model.model." in name for name in shapes):
            raise ValueError("its PaliGemma tensors have the names transformers < 4.52 gave "
                             "them (`paligemma.language_model.model.*`): a π0 of LeRobot "
                             "before 0.4, another port than the openpi one LeRobot 0.4 and "
                             "this project run; start from a LeRobot >= 0.4 π0 (lerobot/"
                             "pi0_base) or an openpi checkpoint")
        dims = {"action_dim": shapes["model.action_in_proj.weight"][1]}
        if "model.state_proj.weight" in shapes:
            dims["state_dim"] = shapes["model.state_proj.weight"][1]
        ours = config.get("kwargs", {}) if "hpcvla_policy" in config else None
        horizon = (ours or {}).get("model_dims", {}).get("horizon") or \
            config.get("chunk_size") or config.get("action_horizon")  # LeRobot, openpi
        if ours is None and not horizon:  # π0's action tokens attend to each other
            raise ValueError(
                "config.json names no action horizon (LeRobot's chunk_size, openpi's "
                "action_horizon; openpi's train_pytorch.py checkpoints hold no config.json): "
                "put beside the weights the config.json openpi's converter writes, or "
                '{"action_horizon": N} with N the training config\'s (openpi: 50, its '
                "pi05_libero 10)")
        size = (ours or {}).get("size")  # ours: the resolved configs
        steps = ours.get("denoise_steps") if ours is not None else \
            config.get("num_inference_steps") or config.get("num_steps") or \
            OPENPI_SAMPLE_STEPS  # LeRobot (num_steps before 0.4), openpi
        return {"model_dims": dict(dims, horizon=horizon) if horizon else dims,
                "variant": "pi05" if "model.time_mlp_in.weight" in shapes else "pi0",
                "size": size if isinstance(size, dict) else paligemma_size(shapes),
                **({"denoise_steps": int(steps)} if steps else {})}


__all__ = ["OPENPI_SAMPLE_STEPS", "PublishedFlowFolders"]
