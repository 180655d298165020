"""The V4.1 vision tower (spec §3.13): images → the embeddings of their placeholder spans.

    patches [N, 3, p, p] (one image: grid h × w patches, row-major, N = h·w)
    x = patch_embed(flatten(patches))                          [N, W]
    for each block:  x += wo(attn(rope2d(wqkv(norm1(x)))))      full attention within the image
                     x += w2(silu(a) ⊙ b), (a, b) = w1(norm2(x))
    x = norm(x)                                                 [N, W]
    aligner: 3×3 pixel-unshuffle (zero-padded to multiples of 3), w2(gelu(w1(·)))
                                                                [rows·cols, D], rows = ⌈h/3⌉, cols = ⌈w/3⌉
    span = [image_start, (row of cols features, image_newline) × rows, image_end]
                                                                [rows·(cols+1) + 2, D]

Every span position carries the placeholder id in the prompt; the backbone replaces those
positions' embeddings by the span rows (``DeepseekV41.embed_inputs``). The 2D RoPE rotates the
two halves of each head (first half: patch row, second half: patch column). Vision RMSNorms use
eps 1e-6 (the backbone's is 1e-20).

Several images are encoded as one batch: every per-patch product runs over all images' patches at
once; only attention is per image. A patch's result never depends on the other images beyond
the GEMM's row blocking (the batch test bounds it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from model.deepseek_v41.norm import RMSNorm
from model.deepseek_v41.vision_config import VisionConfig

VISION_NORM_EPS = 1e-6
IMAGE_START, IMAGE, IMAGE_NEWLINE, IMAGE_END = range(4)  # span position kinds, in NeMo's numbering


def span_rows_cols(grid: tuple[int, int], downsample: int) -> tuple[int, int]:
    """Image-token rows and columns of a ViT grid (h, w) of patches: ⌈h/r⌉ × ⌈w/r⌉."""
    h, w = grid
    return -(-h // downsample), -(-w // downsample)


def span_length(rows: int, cols: int) -> int:
    """Placeholder positions of one image: start, ``rows`` rows of ``cols`` tokens and a newline, end."""
    return rows * (cols + 1) + 2


def span_kinds(rows: int, cols: int) -> list[int]:
    """The kind of every span position (IMAGE_START, IMAGE, IMAGE_NEWLINE, IMAGE_END), in order."""
    return [IMAGE_START] + ([IMAGE] * cols + [IMAGE_NEWLINE]) * rows + [IMAGE_END]


def rope_2d(
    grid: tuple[int, int], head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 [h·w, 1, head_dim/2]: the first head_dim/4 angles from the patch row, the rest from its column."""
    h, w = grid
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half))  # [half/2]
    rows = torch.arange(h, device=device).unsqueeze(1).expand(h, w)
    cols = torch.arange(w, device=device).unsqueeze(0).expand(h, w)
    pos = torch.stack([rows, cols], dim=-1).reshape(-1, 2, 1).float()  # [N, 2, 1]
    angles = (pos * inv_freq).flatten(1)  # [N, half]
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim] rotated pairwise between its two halves (fp32 maths)."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, vcfg: VisionConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = vcfg.num_attention_heads, vcfg.head_dim
        self.wqkv = nn.Linear(vcfg.hidden_size, 3 * vcfg.hidden_size)
        self.wo = nn.Linear(vcfg.hidden_size, vcfg.hidden_size)

    def forward(self, x: torch.Tensor, images: Sequence[tuple[int, int, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """x [N, W] (all images' patches) → [N, W]; ``images``: (first patch, patches, cos, sin) per image."""
        qkv = self.wqkv(x).view(x.shape[0], 3, self.heads, self.head_dim)  # [N, 3, H, hd]
        out = torch.empty(x.shape[0], self.heads, self.head_dim, dtype=x.dtype, device=x.device)
        for start, n, cos, sin in images:
            q, k, v = qkv[start : start + n].unbind(1)  # each [n, H, hd]
            q, k = rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))  # [H, n, hd]
            out[start : start + n] = o.transpose(0, 1)
        return self.wo(out.flatten(1))


class VisionMLP(nn.Module):
    """SwiGLU without biases; ``w1`` holds the gate then the up projection [2·I, W]."""

    def __init__(self, vcfg: VisionConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(vcfg.hidden_size, 2 * vcfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(vcfg.intermediate_size, vcfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, W] → [N, W]
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, vcfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(vcfg.hidden_size, VISION_NORM_EPS)
        self.attn = VisionAttention(vcfg)
        self.norm2 = RMSNorm(vcfg.hidden_size, VISION_NORM_EPS)
        self.mlp = VisionMLP(vcfg)

    def forward(self, x: torch.Tensor, images: Sequence[tuple[int, int, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), images)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, vcfg: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(3 * vcfg.patch_size**2, vcfg.hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # [N, 3, p, p] → [N, W]
        return self.proj(patches.flatten(1))


class VisionTower(nn.Module):
    """The ViT: patches of several images → their normed patch states."""

    def __init__(self, vcfg: VisionConfig) -> None:
        super().__init__()
        self.vcfg = vcfg
        self.patch_embed = PatchEmbed(vcfg)
        self.blocks = nn.ModuleList(VisionBlock(vcfg) for _ in range(vcfg.num_hidden_layers))
        self.norm = RMSNorm(vcfg.hidden_size, VISION_NORM_EPS)

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        """patches [Σ h·w, 3, p, p], images concatenated in ``grids`` order → [Σ h·w, W]."""
        x = self.patch_embed(patches)
        images, start = [], 0
        for grid in grids:
            cos, sin = rope_2d(grid, self.vcfg.head_dim, self.vcfg.rope_theta, x.device)
            images.append((start, grid[0] * grid[1], cos, sin))
            start += grid[0] * grid[1]
        for block in self.blocks:
            x = block(x, images)
        return self.norm(x)


class Aligner(nn.Module):
    """r×r pixel-unshuffle of the ViT grid (zero-padded to multiples of r), then a GELU MLP into D."""

    def __init__(self, vcfg: VisionConfig, hidden_size: int) -> None:
        super().__init__()
        self.ratio = vcfg.downsample_ratio
        self.w1 = nn.Linear(vcfg.hidden_size * self.ratio**2, hidden_size)
        self.w2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        """x [Σ h·w, W] → [Σ rows·cols, D]; each cell's features are channel-major (c, dy, dx)."""
        cells, start, r = [], 0, self.ratio
        for h, w in grids:
            grid = x[start : start + h * w].reshape(h, w, -1).permute(2, 0, 1)  # [W, h, w]
            grid = F.pad(grid, (0, -w % r, 0, -h % r))  # [W, r·rows, r·cols]
            cells.append(F.unfold(grid.unsqueeze(0), r, stride=r)[0].t())  # [rows·cols, W·r·r]
            start += h * w
        return self.w2(F.gelu(self.w1(torch.cat(cells))))


class ImageEncoder(nn.Module):
    """Tower, aligner and the learned span delimiters: images → placeholder-span embeddings."""

    def __init__(self, vcfg: VisionConfig, hidden_size: int) -> None:
        super().__init__()
        self.vcfg = vcfg
        self.vision = VisionTower(vcfg)
        self.aligner = Aligner(vcfg, hidden_size)
        self.image_start = nn.Parameter(torch.zeros(hidden_size))
        self.image_end = nn.Parameter(torch.zeros(hidden_size))
        self.image_newline = nn.Parameter(torch.zeros(hidden_size))

    def features(self, patches: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        """patches [Σ h·w, 3, p, p] → aligned image-token features [Σ rows·cols, D] (no delimiters)."""
        if patches.shape[0] != sum(h * w for h, w in grids):
            raise ValueError(f"{patches.shape[0]} patches for grids {list(grids)}")
        return self.aligner(self.vision(patches, grids), grids)

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """patches [Σ h·w, 3, p, p] → one span per image, [rows·(cols+1) + 2, D] each."""
        features = self.features(patches, grids)
        spans, start = [], 0
        for grid in grids:
            rows, cols = span_rows_cols(grid, self.vcfg.downsample_ratio)
            body = features[start : start + rows * cols].reshape(rows, cols, -1)  # [rows, cols, D]
            newline = self.image_newline.to(body.dtype).expand(rows, 1, -1)
            body = torch.cat([body, newline], dim=1).flatten(0, 1)  # [rows·(cols+1), D]
            spans.append(torch.cat([self.image_start[None].to(body.dtype), body, self.image_end[None].to(body.dtype)]))
            start += rows * cols
        return spans
