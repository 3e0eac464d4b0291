"""OpenVLA-OFT's fused vision backbone, projectors and L1 action head, on transformers modules.

OFT builds its two towers with timm (`vit_large_patch14_reg4_dinov2.lvd142m`,
`vit_so400m_patch14_siglip_224`); timm cannot be installed beside this project's CPU torch
(PyPI's torchvision links a CUDA libtorch), so the same architectures are transformers'
`Dinov2WithRegistersModel` (cls + 4 registers, LayerScale) and `SiglipVisionModel` (no head),
with the timm tensors converted on load (policies/oft_checkpoint.py). What OFT reads from each
tower is the output of block `depth - 2` (timm's `get_intermediate_layers(n={depth - 2})`):
the last block and the final norm are never run (they stay in the module, frozen, so a folder
round-trips), and the prefix tokens (cls + registers) are dropped. The DINOv2 features come
first in the channel concatenation.

Images: "resize-naive" (no letterbox) to the towers' size on the 0-255 scale, rounded
back to integers as RLinf's uint8 `TVF.resize(bicubic, antialias=True)` does (torch's bicubic
antialiased interpolate on float then round/clamp gives the same pixels), then, with
policy.center_crop < 1, OFT's evaluation centre crop (`center_crop`: the same uint8 pixels as
OFT's tensorflow code, tests/fixtures/oft/crop_io.npz), then /255 and each tower's
normalization: channels 0-2 DINOv2's (ImageNet mean/std), 3-5 SigLIP's (0.5/0.5). OFT's own
resize (JPEG round trip, lanczos3) is not reproduced: tests/fixtures/oft/README.md measures it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpcvla.policies.backbones import backbone

DINO_MEAN, DINO_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SIGLIP_MEAN, SIGLIP_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
REGISTERS = 4
# Heads are not in the tensors, and config.json names only timm ids: heads by tower width.
# 1024/1152: the published towers (16 heads each); 20/36: the tiny preset, which is the
# reference fixtures' tiny model (tests/fixtures/oft/summary.json tiny_dims); 128: the small one.
VISION_HEADS = {("dino", 1024): 16, ("siglip", 1152): 16, ("dino", 20): 2, ("siglip", 36): 3,
                ("dino", 128): 4, ("siglip", 128): 4}


def heads_of(tower: str, width: int) -> int:
    try:
        return VISION_HEADS[(tower, width)]
    except KeyError:
        raise ValueError(f"no known {tower} tower of width {width} (the checkpoint names only "
                         f"timm ids; known widths: {sorted(VISION_HEADS)})") from None


def _box_samples(lo: torch.Tensor, hi: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """tf.image.crop_and_resize's sample points along one axis of length n (n out of n), in
    float32 as its CPU kernel: the box [lo, hi] of the image's extent (n - 1) -> index below,
    index above, weight of the one above."""
    step = (hi - lo) * (n - 1) / (n - 1) if n > 1 else torch.zeros_like(lo)
    pos = lo * (n - 1) + torch.arange(n, dtype=torch.float32) * step
    below = pos.floor()
    return below.long(), pos.ceil().long(), pos - below


def center_crop(x: torch.Tensor, area: float) -> torch.Tensor:
    """OFT's evaluation crop (openvla_utils.center_crop_image / crop_and_resize): the centred
    square box of side sqrt(area) of each (B, 3, H, W) image on the 0-255 scale, resampled back
    to H x W bilinearly as tf.image.crop_and_resize does (sample points spanning the box's
    corner pixels; x then y interpolation, float32), of the image divided by 255, then back to
    integers as tf.image.convert_image_dtype does (clip to [0, 1], x 255.5, truncate).
    `area` 1: the image as it is."""
    if area >= 1.0:
        return x
    # float32 as tf.sqrt; through float64, as torch's float32 sqrt is not correctly rounded
    side = torch.tensor(area, dtype=torch.float32).double().sqrt().float().clamp(0.0, 1.0)
    lo = (1 - side) / 2
    v = x.float() * torch.tensor(1 / 255, dtype=torch.float32)
    (top, bottom, wy), (left, right, wx) = (_box_samples(lo, lo + side, n)
                                            for n in x.shape[-2:])
    wx, wy = wx.to(x.device), wy.to(x.device)
    rows = []
    for index in (top, bottom):  # x interpolation on the rows above and below
        row = v[..., index.to(x.device), :]
        a, b = row[..., left.to(x.device)], row[..., right.to(x.device)]
        rows.append(a + (b - a) * wx)
    v = rows[0] + (rows[1] - rows[0]) * wy[:, None]
    return (v.clamp(0.0, 1.0) * torch.tensor(255.5, dtype=torch.float32)).clamp(0, 255).floor()


def pixel_values(cameras: list[torch.Tensor], side: int, crop: float = 1.0) -> torch.Tensor:
    """Camera images (B, H, W, 3) on the 0-255 scale -> (B, 6 x cameras, side, side). `crop`
    < 1: OFT's centre crop of that area fraction (`center_crop`, policy.center_crop) after the
    resize, as OFT crops the image resize_image_for_policy made (its processor's resize to the
    same size changes nothing)."""
    out = []
    for image in cameras:
        x = image.permute(0, 3, 1, 2).float()
        if tuple(x.shape[-2:]) != (side, side):
            x = F.interpolate(x, size=(side, side), mode="bicubic", antialias=True,
                              align_corners=False).round().clamp(0.0, 255.0)
        x = center_crop(x, crop) / 255.0
        for mean, std in ((DINO_MEAN, DINO_STD), (SIGLIP_MEAN, SIGLIP_STD)):
            out.append((x - x.new_tensor(mean)[:, None, None]) / x.new_tensor(std)[:, None, None])
    return torch.cat(out, dim=1)


class FusedVisionBackbone(nn.Module):
    """DINOv2-with-registers (`featurizer`) + SigLIP (`fused_featurizer`), OFT's names, built
    in `dtype`."""

    def __init__(self, dims: dict, dtype: torch.dtype = torch.float32):
        super().__init__()
        from transformers import (Dinov2WithRegistersConfig, Dinov2WithRegistersModel,
                                  SiglipVisionConfig, SiglipVisionModel)

        dino, siglip = dims["dino"], dims["siglip"]
        if dino["intermediate_size"] % dino["hidden_size"]:  # transformers takes an int ratio
            raise ValueError(f"DINOv2 MLP width {dino['intermediate_size']} is not a multiple "
                             f"of its width {dino['hidden_size']}")
        common = dict(image_size=dims["image_size"], patch_size=dims["patch_size"],
                      hidden_act="gelu", layer_norm_eps=1e-6)
        self.featurizer = backbone(Dinov2WithRegistersModel, Dinov2WithRegistersConfig(
            hidden_size=dino["hidden_size"], num_hidden_layers=dino["num_hidden_layers"],
            num_attention_heads=heads_of("dino", dino["hidden_size"]),
            mlp_ratio=dino["intermediate_size"] // dino["hidden_size"],
            num_register_tokens=REGISTERS, **common), dtype=dtype)
        self.fused_featurizer = backbone(SiglipVisionModel, SiglipVisionConfig(
            hidden_size=siglip["hidden_size"], intermediate_size=siglip["intermediate_size"],
            num_hidden_layers=siglip["num_hidden_layers"],
            num_attention_heads=heads_of("siglip", siglip["hidden_size"]),
            vision_use_head=False, **common), dtype=dtype)
        # timm has no mask token (it is only for masked pre-training): not part of the model
        del self.featurizer.embeddings.mask_token
        for unused in (self.featurizer.encoder.layer[-1], self.featurizer.layernorm,
                       self.fused_featurizer.encoder.layers[-1],
                       self.fused_featurizer.post_layernorm):
            unused.requires_grad_(False)  # never run: features come from block depth - 2
        self.width = dino["hidden_size"] + siglip["hidden_size"]
        self.image_size = dims["image_size"]
        self.patches = (dims["image_size"] // dims["patch_size"]) ** 2

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 6 n, S, S) -> (B, n x patches, dino + siglip width): the images' patch
        features one image after another."""
        dtype = self.featurizer.embeddings.cls_token.dtype
        features = []
        for image in pixels.to(dtype).split(6, dim=1):
            dino = self.featurizer.embeddings(image[:, :3])
            for layer in self.featurizer.encoder.layer[:-1]:
                dino = layer(dino, None)
            siglip = self.fused_featurizer.embeddings(image[:, 3:])
            for layer in self.fused_featurizer.encoder.layers[:-1]:
                siglip = layer(siglip, None)
            features.append(torch.cat([dino[:, 1 + REGISTERS:], siglip], dim=-1))
        return torch.cat(features, dim=1)


class Projector(nn.Module):
    """OFT's fused-GELU MLP projector: vision width -> 4x -> LLM width -> LLM width."""

    def __init__(self, vision_width: int, llm_width: int):
        super().__init__()
        self.fc1 = nn.Linear(vision_width, 4 * vision_width)
        self.fc2 = nn.Linear(4 * vision_width, llm_width)
        self.fc3 = nn.Linear(llm_width, llm_width)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


class ProprioProjector(nn.Module):
    """OFT's state token: the normalized state -> LLM width (fc1, GELU, fc2)."""

    def __init__(self, state_dim: int, llm_width: int):
        super().__init__()
        self.fc1 = nn.Linear(state_dim, llm_width)
        self.fc2 = nn.Linear(llm_width, llm_width)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class L1ActionHead(nn.Module):
    """OFT's L1-regression action head (its own LIBERO recipe): per decoded step, the last
    hidden states of that step's D action positions, concatenated (D x width), through an MLP
    with 2 pre-norm residual blocks -> the step's D normalized actions. Module names are OFT's
    (`model.*`), so its `action_head--*.pt` loads as it is (less DDP's `module.`)."""

    def __init__(self, llm_width: int, action_dim: int, blocks: int = 2):
        super().__init__()
        self.model = nn.Module()
        self.model.layer_norm1 = nn.LayerNorm(llm_width * action_dim)
        self.model.fc1 = nn.Linear(llm_width * action_dim, llm_width)
        self.model.mlp_resnet_blocks = nn.ModuleList(nn.Module() for _ in range(blocks))
        for block in self.model.mlp_resnet_blocks:
            block.ffn = nn.Sequential(nn.LayerNorm(llm_width), nn.Linear(llm_width, llm_width),
                                      nn.ReLU())
        self.model.layer_norm2 = nn.LayerNorm(llm_width)
        self.model.fc2 = nn.Linear(llm_width, action_dim)

    def forward(self, hidden: torch.Tensor, steps: int) -> torch.Tensor:
        """(B, steps x D, width) action-position hidden states -> (B, steps, D)."""
        m = self.model
        x = F.relu(m.fc1(m.layer_norm1(hidden.reshape(hidden.shape[0], steps, -1))))
        for block in m.mlp_resnet_blocks:
            x = x + block.ffn(x)
        return m.fc2(m.layer_norm2(x))


__all__ = ["FusedVisionBackbone", "Projector", "ProprioProjector", "L1ActionHead",
           "center_crop", "pixel_values", "heads_of"]
