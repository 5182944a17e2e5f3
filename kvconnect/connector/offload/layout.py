"""The paged KV cache as the offload worker reads and writes it, whatever the engine's layout.

Each layer is seen through one 6-dim view of the engine's own memory (no copy, any strides):

    [num_blocks, kernel_blocks, kernel_block_tokens, heads, planes, dim]
         B             R                 N             H      P      D

    B     the engine's blocks: the ids the scheduler sends
    R, N  a block's tokens: R kernel blocks of N tokens each (vLLM splits a 256-token block
          into the block size its attention kernel takes; R = 1 otherwise), token t of a
          block is kernel block t // N, row t % N
    H     this rank's KV heads (vLLM's head slots)
    P, D  a (token, head)'s content: P = 2 planes (K, V) of D elements when K and V have one
          width; P = 1 when the content is one run (an MLA latent, K||V of two widths, a
          quantized cache that packs its scales in the content)

A chunk of T tokens is [num_layers, P, T, H, D], contiguous: the same bytes whatever the
physical order (NHD or HND, layers or blocks outermost), so engines with another layout read
the same entries. A dtype the tiers cannot name (fp8 e5m2, packed fp4) is viewed as bytes
(uint8, D times the element size): copies move bytes, nothing is converted.

`from_kv_planes` is kvconnect's own engine ([2, B, N, H, D] per layer); `from_logical` is
vLLM 0.33's [B * R, H, N, C] per-layer view (kvconnect/vllm/layout.py reads its descriptors);
both end here, so the worker has one gather and one scatter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

STORABLE_DTYPES = frozenset(
    {
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.float8_e4m3fn,
    }
)
"""Dtypes a tier's chunk format names (tiers/base.py's DTYPES); others are stored as bytes."""


class LayoutError(ValueError):
    """A layer's cache that the connector refuses: one line naming the layer, its layout and
    its shape, raised when the caches are registered (at start)."""


def refusal(layer: str, layout: str, tensor: torch.Tensor, why: str) -> LayoutError:
    return LayoutError(
        f"kvconnect OffloadConnector: layer {layer}: {layout} cache of shape "
        f"{list(tensor.shape)} (strides {list(tensor.stride())}, {tensor.dtype}): {why}"
    )


def as_storable(view: torch.Tensor) -> torch.Tensor:
    """`view` itself, or its bytes (last dim times the element size) for a dtype the tiers
    cannot name; the content dim must be the innermost one in memory, as in every layout."""
    if view.dtype in STORABLE_DTYPES:
        return view
    return view.view(torch.uint8)


def from_kv_planes(name: str, kv: torch.Tensor) -> torch.Tensor:
    """[2 (K, V), B, N, H, D] (kvconnect's engine, vLLM 0.32's flash layout) as the 6-dim view."""
    if kv.dim() != 5 or kv.shape[0] != 2:
        raise refusal(name, "[2, blocks, tokens, heads, dim]", kv, "not that shape")
    return as_storable(kv.permute(1, 2, 3, 0, 4).unsqueeze(1))


def from_logical(
    name: str,
    view: torch.Tensor,
    num_blocks: int,
    kv_width: int | None,
    layout: str,
    kv_rows: bool = False,
) -> torch.Tensor:
    """vLLM 0.33's logical per-layer view [B * R, H, N, C] (any physical order) as the 6-dim
    view. What C holds is the attention backend's: `kv_width` splits a token's C into K and V
    planes of that width (flash-style backends: `split(head_size, dim=-1)`); `kv_rows` reads
    a (block, head)'s [N, C] as K rows then V rows of C / 2 (CPU_ATTN:
    `view(blocks, heads, 2 * N, -1).chunk(2, dim=2)`); neither: one opaque run per token."""
    if view.dim() != 4 or view.shape[0] % num_blocks:
        raise refusal(
            name, layout, view, f"not [blocks x k, heads, tokens, content] ({num_blocks} blocks)"
        )
    if view.stride(3) != 1:
        raise refusal(name, layout, view, "its content is not contiguous")
    blocks = view.view(num_blocks, view.shape[0] // num_blocks, *view.shape[1:])  # [B, R, H, N, C]
    if kv_rows:
        b, r, h, n, c = blocks.shape
        if c % 2 or blocks.stride(3) != c:
            raise refusal(name, layout, view, "K and V rows need each (block, head) contiguous")
        rows = blocks.view(b, r, h, 2, n, c // 2)  # [B, R, H, 2, N, D]
        return as_storable(rows.permute(0, 1, 4, 2, 3, 5))
    blocks = blocks.permute(0, 1, 3, 2, 4)  # [B, R, N, H, C]
    if kv_width is not None and blocks.shape[-1] == 2 * kv_width:
        return as_storable(blocks.view(*blocks.shape[:-1], 2, kv_width))
    return as_storable(blocks.unsqueeze(-2))


def unique_layers(views: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`views` without the layers that are another layer's memory (vLLM's KV sharing binds
    a layer to an earlier layer's cache): each byte is stored once."""
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, v in views.items():
        key = (v.data_ptr(), tuple(v.shape), tuple(v.stride()))
        if key not in seen:
            seen.add(key)
            out[name] = v
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s memory as bytes (copies move bytes: index kernels do not exist for every dtype)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


@dataclass(frozen=True)
class PagedKV:
    """Every layer's 6-dim view (module docstring), one shape and dtype for all."""

    names: tuple[str, ...]
    layers: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        if not self.layers:
            raise LayoutError("kvconnect OffloadConnector: no KV cache layer to offload")
        first = self.layers[0]
        for name, layer in zip(self.names, self.layers, strict=True):
            if layer.dim() != 6:
                raise refusal(name, "view [B, R, N, H, P, D]", layer, "not 6-dim")
            if layer.shape[1:] != first.shape[1:] or layer.dtype != first.dtype:
                raise refusal(
                    name,
                    "view [B, R, N, H, P, D]",
                    layer,
                    f"differs from layer {self.names[0]}'s {list(first.shape)} {first.dtype}; "
                    "a chunk needs one shape per token for every layer",
                )
            if layer.device != first.device:
                raise refusal(
                    name, "view [B, R, N, H, P, D]", layer, f"on {layer.device}, not {first.device}"
                )

    @classmethod
    def from_views(cls, views: Mapping[str, torch.Tensor]) -> PagedKV:
        unique = unique_layers(views)
        return cls(tuple(unique), tuple(unique.values()))

    @property
    def block_size(self) -> int:
        return int(self.layers[0].shape[1] * self.layers[0].shape[2])

    @property
    def num_blocks(self) -> int:
        return int(self.layers[0].shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        """[num_layers, planes, num_tokens, heads, dim]"""
        _, _, _, heads, planes, dim = self.layers[0].shape
        return (len(self.layers), planes, num_tokens, heads, dim)

    def _runs(self, block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
        """(position in the chunk, first block id, length) of each run of consecutive ids.
        Copies go run by run through plain slices: index_copy_/index_select took 3.5 times
        as long on CPU (bench/vllm_offload.py's 16-chunk load: 138 ms against 40), and need
        no index tensor (on CUDA, one host-to-device copy fewer per chunk)."""
        num = self.num_blocks
        runs: list[tuple[int, int, int]] = []
        for i, b in enumerate(block_ids):
            if not 0 <= b < num:
                raise IndexError(f"block id {b} is outside the cache's {num} blocks")
            if runs and runs[-1][1] + runs[-1][2] == b:
                pos, first, length = runs[-1]
                runs[-1] = (pos, first, length + 1)
            else:
                runs.append((i, b, 1))
        return runs

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks' KV as a chunk [layers, P, len(block_ids) * block_size, H, D], a new
        tensor on the cache's device (on CUDA: issued on the caller's current stream)."""
        runs = self._runs(block_ids)
        out = torch.empty(
            self.chunk_shape(len(block_ids) * self.block_size), dtype=self.dtype, device=self.device
        )
        _, r, n, h, p, d = _bytes(self.layers[0]).shape
        for layer, dst in zip(self.layers, _bytes(out), strict=True):
            # [b, R, N, H, P, D] -> [P, b, R, N, H, D]: tokens in block order, per plane
            blocks = dst.view(p, len(block_ids), r, n, h, d)
            source = _bytes(layer)
            for pos, first, length in runs:
                run = source[first : first + length].permute(4, 0, 1, 2, 3, 5)
                blocks[:, pos : pos + length].copy_(run)
        return out

    def scatter(self, block_ids: Sequence[int], chunk: torch.Tensor) -> None:
        """Write `chunk` ([layers, P, len(block_ids) * block_size, H, D], on the cache's
        device) into the blocks: the inverse of `gather`."""
        runs = self._runs(block_ids)
        _, r, n, h, p, d = _bytes(self.layers[0]).shape
        for layer, src in zip(self.layers, _bytes(chunk), strict=True):
            blocks = src.reshape(p, len(block_ids), r, n, h, d).permute(1, 2, 3, 4, 0, 5)
            target = _bytes(layer)
            for pos, first, length in runs:
                target[first : first + length].copy_(blocks[pos : pos + length])
