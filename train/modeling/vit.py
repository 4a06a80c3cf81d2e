"""Vision Transformers (ViT-S/16, ViT-B/16) in plain torch with timm's tensor names and shapes.

The names are those of timm's ``VisionTransformer`` (and so of the
``.safetensors`` files published for it, supervised or self-supervised):
``cls_token``, ``pos_embed``, ``patch_embed.proj``, ``blocks.{i}.norm1``,
``attn.qkv``, ``attn.proj``, ``norm2``, ``mlp.fc1``, ``mlp.fc2``, ``norm``
and the classifier ``head`` (left out here: the embedding head replaces it).
The computation is timm's too (pre-norm blocks, LayerNorm eps 1e-6, exact
GELU, fused attention), so the same weights give the same tokens.

Output for the embedding head: the patch tokens after the final ``norm``,
laid out as a (N, D, H/16, W/16) map, so the trainer's pooling applies to
them (``avg`` is the mean of the patch tokens, timm's ``global_pool='avg'``).
The class token takes part in every attention layer, so its weights are used
and trained, but it is not pooled.

Position embeddings are learnt for one grid of patches; for another image
size they are resampled bicubically with the class token's embedding kept
(:func:`resample_pos_embed`, the rule of timm's ``resample_abs_pos_embed``),
both when a file is loaded for another size and when an image of another size
is embedded.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from pksampler.train.errors import ConfigError

__all__ = ["VITS", "VisionTransformer", "resample_pos_embed", "vit"]

PATCH = 16


class Attention(nn.Module):
    """Multi-head self-attention with one fused ``qkv`` projection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, dim))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """16x16 patches to tokens by one strided convolution (``patch_embed.proj``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, PATCH, PATCH)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(images)


def resample_pos_embed(pos_embed: torch.Tensor, grid: tuple[int, int], *, prefix_tokens: int = 1) -> torch.Tensor:
    """Position embeddings (1, prefix + h*w, D) resampled to ``grid`` (bicubic, antialiased); prefix tokens kept.

    The stored grid must be square (as every published ViT's is).
    """
    prefix, patches = pos_embed[:, :prefix_tokens], pos_embed[:, prefix_tokens:]
    side = math.isqrt(patches.shape[1])
    if side == 0 or side * side != patches.shape[1]:  # 0: only the prefix tokens were stored
        raise ValueError(f"pos_embed holds {patches.shape[1]} patch positions, not a square grid")
    if (side, side) == tuple(grid):
        return pos_embed
    dim = patches.shape[2]
    image = patches.reshape(1, side, side, dim).permute(0, 3, 1, 2).float()
    image = F.interpolate(image, size=tuple(grid), mode="bicubic", antialias=True, align_corners=False)
    patches = image.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], dim).to(pos_embed.dtype)
    return torch.cat([prefix, patches], dim=1)


class VisionTransformer(nn.Module):
    """ViT trunk: input (N, 3, H, W), output the normalised patch tokens as a (N, D, H/16, W/16) map.

    Args:
        dim: token width (384 for ViT-S, 768 for ViT-B).
        depth: number of blocks.
        heads: attention heads.
        image_size: the training image size; sets the learnt grid of ``pos_embed``.
    """

    def __init__(self, dim: int, depth: int, heads: int, *, image_size: int = 224) -> None:
        super().__init__()
        if image_size < PATCH:
            raise ConfigError(f"data.image_size: must be at least {PATCH} for a ViT with {PATCH}x{PATCH} patches, "
                              f"got {image_size}")
        self.grid = (image_size // PATCH, image_size // PATCH)
        self.num_features = dim
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + self.grid[0] * self.grid[1], dim))
        self.patch_embed = PatchEmbed(dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self._initialise()

    def _initialise(self) -> None:
        """timm's initialisation, for training from scratch (truncated normal 0.02, zero biases)."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)

    def forward_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """All tokens after the final norm, (N, 1 + h*w, D), class token first (timm's ``forward_features``)."""
        patches = self.patch_embed(images)
        grid = tuple(patches.shape[2:])
        tokens = patches.flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls_token.expand(tokens.shape[0], -1, -1), tokens], dim=1)
        pos_embed = self.pos_embed if grid == self.grid else resample_pos_embed(self.pos_embed, grid)
        return self.norm(self.blocks(tokens + pos_embed))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.forward_tokens(images)[:, 1:]
        height, width = images.shape[2] // PATCH, images.shape[3] // PATCH
        return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], height, width)


#: ``model.backbone`` name -> (width, depth, heads), as timm defines them
VITS: dict[str, tuple[int, int, int]] = {
    "vit_small_patch16": (384, 12, 6),
    "vit_base_patch16": (768, 12, 12),
}


def vit(name: str, *, image_size: int = 224) -> VisionTransformer:
    """``vit_small_patch16`` or ``vit_base_patch16`` for ``image_size`` px images, without the classifier."""
    if name not in VITS:
        raise ValueError(f"model.backbone must be one of {list(VITS)} for a ViT, got {name!r}")
    dim, depth, heads = VITS[name]
    return VisionTransformer(dim, depth, heads, image_size=image_size)
