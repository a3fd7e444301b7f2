"""A prompt's images as the engine keeps them (vLLM's multi_modal_data, for Qwen2.5-VL and Qwen3-VL): each image
through the model's own image processor (transformers' AutoImageProcessor: its resizing, patching, normalisation),
its placeholder in the prompt expanded to the image's token count, a content hash, and the prompt's M-RoPE positions.

The hash is SHA-256 over the image's pixels (mode, size and bytes, as vLLM's multimodal hasher takes a PIL image): it
keys the vision encoder's output cache (backend/engine/encoder_cache.py) and enters the prefix cache's hash of every
block the image's tokens cover (backend/engine/kv_cache.py), so the same text with another image never hits.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

# vLLM's default limit for a modality left out of limit_mm_per_prompt
DEFAULT_IMAGE_LIMIT = 999


@dataclass(frozen=True, eq=False)
class ImageItem:
    """One image of a prompt: what the vision encoder reads, and where its embeddings go."""

    hash: bytes
    pixel_values: torch.Tensor  # [patches, channels * temporal_patch * patch * patch], as the image processor made it
    grid_thw: tuple[int, int, int]  # patches in time, height and width
    offset: int  # the prompt index of its first placeholder token
    length: int  # its placeholder tokens: its embedding rows

    def overlaps(self, start: int, stop: int) -> bool:
        return self.offset < stop and start < self.offset + self.length


@dataclass(eq=False)
class MultiModalInputs:
    """A prompt's images, and its tokens' M-RoPE positions (three streams: time, height, width)."""

    images: list[ImageItem]
    positions: np.ndarray = field(repr=False)  # int64 [3, prompt tokens]
    delta: int  # a token after the prompt at index i has position i + delta in every stream

    def positions_of(self, start: int, stop: int) -> np.ndarray:
        """[3, stop - start] positions of tokens start..stop (the prompt's, then i + delta)."""
        prompt = self.positions.shape[1]
        head = self.positions[:, start:min(stop, prompt)]
        tail = np.arange(max(start, prompt), stop, dtype=np.int64) + self.delta
        return np.concatenate((head, np.broadcast_to(tail, (3, len(tail)))), axis=1)

    def images_in(self, start: int, stop: int) -> list[ImageItem]:
        """The images whose tokens lie (some of them) in start..stop, in order."""
        return [image for image in self.images if image.overlaps(start, stop)]

    def hashes_in(self, start: int, stop: int) -> bytes:
        """The hashes of the images whose tokens lie in start..stop: what a block's hash adds."""
        return b"".join(image.hash for image in self.images_in(start, stop))


def text_positions(start: int, stop: int) -> np.ndarray:
    """[3, stop - start] M-RoPE positions of text alone: the token's index in every stream."""
    return np.broadcast_to(np.arange(start, stop, dtype=np.int64), (3, stop - start))


def image_hash(image) -> bytes:
    """Of an RGB image (a palette image's indices alone would not tell two palettes apart)."""
    return hashlib.sha256(f"{image.mode}:{image.size}".encode() + image.tobytes()).digest()


class ImageProcessor:
    """The model's image processor and placeholder: images of one prompt into an ImageItem each."""

    def __init__(self, model_dir: Path, hf_config, limit: int = DEFAULT_IMAGE_LIMIT):
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(str(model_dir))
        self.image_token_id = hf_config.image_token_id
        self.merge_size = hf_config.vision_config.spatial_merge_size
        self.limit = limit

    def process(self, ids: list[int], images: list) -> tuple[list[int], MultiModalInputs]:
        """The prompt's ids with each image's placeholder expanded to its token count (a placeholder already expanded
        is kept), and its MultiModalInputs; a ValueError naming what does not match."""
        if len(images) > self.limit:
            raise ValueError(f"At most {self.limit} image(s) may be provided in one prompt "
                             "(limit_mm_per_prompt raises the limit)")
        runs = _runs_of(ids, self.image_token_id)
        if len(runs) != len(images):
            raise ValueError(f"the prompt has {len(runs)} image placeholder(s) for {len(images)} image(s): put the "
                             "model's placeholder (its chat template writes it for each image part) once per image")
        for i, image in enumerate(images):
            if not hasattr(image, "convert") or not hasattr(image, "size"):
                raise ValueError(f"image {i}: expected a PIL image, got {type(image).__name__}")
        if not images:
            return ids, MultiModalInputs([], text_positions(0, len(ids)), 0)
        images = [image.convert("RGB") for image in images]
        processed = self.processor(images=images, return_tensors="pt")
        grids = [tuple(int(n) for n in g) for g in processed["image_grid_thw"]]
        pixels = torch.split(processed["pixel_values"], [t * h * w for t, h, w in grids])
        out, items, last = [], [], 0
        for (start, run), image, grid, values in zip(runs, images, grids, pixels):
            length = grid[0] * grid[1] * grid[2] // self.merge_size**2
            if run not in (1, length):
                raise ValueError(f"an image placeholder of {run} tokens for an image of {length}")
            out += ids[last:start]
            items.append(ImageItem(image_hash(image), values, grid, len(out), length))
            out += [self.image_token_id] * length
            last = start + run
        out += ids[last:]
        positions, delta = mrope_positions(len(out), items, self.merge_size)
        return out, MultiModalInputs(items, positions, delta)


def _runs_of(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token` in ids."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def mrope_positions(num_tokens: int, images: list[ImageItem], merge_size: int) -> tuple[np.ndarray, int]:
    """transformers' get_rope_index for images: text counts up in all three streams; an image's tokens sit at the
    next position plus their (frame, row, column) in the merged grid; the text after it starts past its largest.
    Returns ([3, num_tokens] positions, the delta of the tokens after them)."""
    parts, next_position, index = [], 0, 0
    for image in images:
        parts.append(text_positions(0, image.offset - index) + next_position)
        next_position += image.offset - index
        t, h, w = image.grid_thw[0], image.grid_thw[1] // merge_size, image.grid_thw[2] // merge_size
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
        parts.append(grid + next_position)
        next_position += max(t, h, w)
        index = image.offset + image.length
    parts.append(text_positions(0, num_tokens - index) + next_position)
    positions = np.concatenate(parts, axis=1)
    return positions, int(positions.max()) + 1 - num_tokens
