"""LoRA adapters (peft) on a VLA policy's language models: `policy.lora_rank` > 0.

Every transformers model of the policy (vision towers, language model, π0's action expert)
keeps its pretrained weights frozen; the language models' attention and MLP projections get
low-rank adapters (`LoraLayer`s, peft's `inject_adapter_in_model`), which train beside what
the policy adds to them (projectors, action heads, the value head, the exploration std).
Frozen tensors cross the weight plane once (transport/weights.py), so each new version
carries the adapters and heads only. Names: a projection's weight becomes
`....q_proj.base_layer.weight` beside `....q_proj.lora_A.default.weight` and `lora_B`, in
checkpoints too; `merge_lora` folds the adapters into the weights and restores the plain
names (a folder that loads without LoRA: `hpcvla export`).
"""

from __future__ import annotations

# Llama/Gemma decoder projections (the language models and π0's expert)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_lora(policy, rank: int, alpha: float) -> None:
    """Freeze every transformers model of `policy` and put adapters of `rank` (scale
    alpha / rank) on the projections of its language models (`policy.lora_models()`)."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import PreTrainedModel
    for module in policy.modules():
        if isinstance(module, PreTrainedModel):
            module.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none",
                        target_modules=list(TARGETS))
    dtype = next(policy.parameters()).dtype
    for model in policy.lora_models():
        inject_adapter_in_model(config, model)
        for name, param in model.named_parameters():
            if "lora_" in name:  # peft makes them float32; the policy computes in its dtype
                param.data = param.data.to(dtype)


def merge_lora(policy) -> int:
    """Fold every adapter into its base weight and put the plain layer back in its place
    (the plain names again); returns how many layers were merged."""
    from peft.tuners.lora import LoraLayer
    merged = 0
    for parent in list(policy.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoraLayer):
                child.merge()
                setattr(parent, name, child.get_base_layer())
                merged += 1
    return merged


def adapter_parameters(policy) -> int:
    """Elements of the LoRA adapters of `policy`."""
    return sum(p.numel() for n, p in policy.named_parameters() if "lora_" in n)


__all__ = ["TARGETS", "add_lora", "adapter_parameters", "merge_lora"]
