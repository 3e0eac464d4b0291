"""The sizes of a published π0/π0.5 checkpoint, read from its tensors' shapes (the folders'
config.json name the full-size variants whatever the real widths are)."""

from __future__ import annotations

import math

PI0_PREFIX = "model.paligemma_with_expert."  # LeRobot's (and openpi's, after `model.`) names


def paligemma_size(shapes: dict) -> dict[str, dict]:
    """The transformers configs of a published π0/π0.5 from its tensors' shapes (HF names):
    widths, depths, MLP widths, vocabulary, patch and image size. Head counts are not in the
    shapes: Gemma's 8 query heads (π0's, at every size; LeRobot hard-codes them) and SigLIP
    So400m's head width 72 give them."""
    def layers(prefix):
        return len({k[len(prefix):].split(".")[0] for k in shapes if k.startswith(prefix)})

    def gemma(prefix):
        q_rows, width = shapes[prefix + "layers.0.self_attn.q_proj.weight"]
        head_dim = q_rows // 8
        return dict(hidden_size=width, num_hidden_layers=layers(prefix + "layers."),
                    intermediate_size=shapes[prefix + "layers.0.mlp.gate_proj.weight"][0],
                    num_attention_heads=8, head_dim=head_dim, num_key_value_heads=shapes[
                        prefix + "layers.0.self_attn.k_proj.weight"][0] // head_dim)

    vision = PI0_PREFIX + "paligemma.model.vision_tower.vision_model."
    width, _, patch, _ = shapes[vision + "embeddings.patch_embedding.weight"]
    if width % 72:
        raise ValueError(f"the checkpoint's SigLIP tower is {width} wide, not a multiple of "
                         "So400m's head width 72: its head count is unknown")
    positions = shapes[vision + "embeddings.position_embedding.weight"][0]
    text = gemma(PI0_PREFIX + "paligemma.model.language_model.")
    text["vocab_size"] = shapes.get(PI0_PREFIX + "paligemma.lm_head.weight", shapes.get(
        PI0_PREFIX + "paligemma.model.language_model.embed_tokens.weight"))[0]
    return {"vision": dict(hidden_size=width, num_attention_heads=width // 72, patch_size=patch,
                           num_hidden_layers=layers(vision + "encoder.layers."),
                           intermediate_size=shapes[vision + "encoder.layers.0.mlp.fc1.weight"][0],
                           image_size=patch * math.isqrt(positions)),
            "text": text, "expert": gemma(PI0_PREFIX + "gemma_expert.model.")}


__all__ = ["PI0_PREFIX", "paligemma_size"]
