"""ModelRunner: owns the model and its KV tensors, turns scheduled chunks into one forward pass."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from backend.engine.decode_graphs import DecodeGraphs
from backend.engine.encoder_cache import EncoderCache
from backend.engine.image_inputs import ImageItem, text_positions
from backend.engine.lora_manager import LoRAManager
from backend.engine.lora_request import LoRARequest
from backend.engine.outputs import Logprob
from backend.engine.sampler import ranked_logprobs
from backend.platform import Platform
from npu_llm_kernels import AttentionMetadata
from npu_llm_kernels.metadata import cdiv
from npu_llm_kernels.timing import scope


# Tokens of the warm-up prefill: enough for the prefill code paths, cheap at start-up.
WARM_UP_TOKENS = 256


# Prompt logprobs are computed this many rows at a time: the [rows, vocab] logits of one block at most, never a
# chunk's or a prompt's.
PROMPT_LOGPROBS_ROWS = 128


@dataclass
class PromptScoring:
    """The prompt tokens a prefill chunk scores: row `first_row` of the chunk (and the rows after it) predicts
    targets[0] (and those after it), with the `top` most likely alternatives at each."""

    first_row: int
    targets: list[int]
    top: int


@dataclass
class SequenceChunk:
    """One sequence's share of a step: new tokens to run after `num_computed` cached ones."""

    token_ids: list[int]
    num_computed: int
    block_ids: list[int]  # the sequence's block table; covers num_computed + len(token_ids) tokens
    wants_logits: bool = True  # False for a prefill chunk that does not reach the end of the prompt
    prompt_scoring: PromptScoring | None = None  # the prompt logprobs it computes, if asked for
    num_drafts: int = 0  # draft tokens ending token_ids, to verify: the logits after each are wanted too
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    # a vision-language model's: the tokens' M-RoPE positions [3, tokens] (None: text's), and the prompt's images
    # whose tokens the chunk holds (only those: under tensor parallel, chunks travel to every rank each step)
    positions: np.ndarray | None = None
    images: list[ImageItem] = field(default_factory=list)


@dataclass
class DraftChunk:
    """One sequence's share of the draft head's pass (backend/models/mtp.py, eagle.py): the positions from
    num_computed on that the step computed and kept, with the token after each and the target's hidden rows there."""

    next_ids: list[int]
    num_computed: int
    block_ids: list[int]
    hidden_rows: list[int]  # rows of the hidden states it reads (ModelRunner.draft's source), one per position
    wants_draft: bool  # it decodes next: draft its next token


@dataclass
class StepOutput:
    logits: torch.Tensor  # fp32 [n, vocab]: the next token's, for the chunks that want logits, in their order
    # per chunk, in their order: its prompt targets' logprobs (sampler.ranked_logprobs' entries), or None
    prompt_logprobs: list[list[dict[int, Logprob]] | None]
    # fp32 [drafts, vocab], where chunks carry drafts: the logits after each draft, chunk after chunk in their order
    draft_logits: torch.Tensor | None = None
    # with a draft head: per chunk, in their order, the row of its first token in the hidden states the head reads
    # (which each rank keeps: ModelRunner.draft)
    first_rows: list[int] | None = None


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, lora: LoRAManager | None = None):
        self.model = model
        self.lora = lora  # with enable_lora: the adapters this rank holds (backend/engine/lora_manager.py)
        self._draft_sources: dict[str, torch.Tensor] = {}  # with a draft head: the hidden states its pass reads
        self.block_size = block_size
        self.device = torch.device(device)
        self.decode_graphs: DecodeGraphs | None = None
        # a vision-language model's image embeddings, by image (backend/engine/encoder_cache.py)
        self.encoder_cache = EncoderCache() if model.is_multimodal else None
        self.allocate_kv_cache(num_blocks)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The KV tensors for num_blocks blocks, plus one: a scratch block no request owns, where dummy steps (the
        memory profile, the warm-up) and a captured batch's padding rows put their K/V. Where the kernels skip
        padded slots (the NPU's), those rows write nothing. Zero blocks leave only the scratch block."""
        if self.decode_graphs is not None:
            raise RuntimeError("the decode graphs read the KV tensors: allocate the cache before capturing them")
        shape = (num_blocks + 1, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        self.kv_caches = []  # the old tensors go before the new ones are made
        self.kv_caches = [self._layer_cache(shape) for _ in range(self.model.num_layers)]
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.dropped_block = num_blocks if self.model.ops.SKIPS_PAD_SLOTS else None

    def _layer_cache(self, shape) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) of a layer; a latent cache (DeepSeek's MLA) as the platform's MLA kernels lay it
        out (one tensor read as both, or the NPU's latent and rope parts)."""
        if self.model.latent_kv:
            return self.model.ops.MLA.kv_cache(shape, self.model.kv_lora_rank, self.model.dtype, self.device)
        return tuple(torch.zeros(shape, dtype=self.model.dtype, device=self.device) for _ in range(2))

    def release_kv_cache(self) -> None:
        """Free the KV tensors, and the decode graphs that read them: the engine is shut down."""
        self.decode_graphs = None
        self.kv_caches = []
        self.num_blocks = 0

    def capture_decode_graphs(self, platform: Platform, max_num_seqs: int, max_len: int) -> None:
        """From now on, decode-only steps replay captured device graphs (see decode_graphs); not for M-RoPE's
        positions (vision-language models), which the graphs do not take."""
        if self.model.is_multimodal:
            return
        self.decode_graphs = self.build_decode_graphs(platform, max_num_seqs, max_len)

    def build_decode_graphs(self, platform: Platform, max_num_seqs: int, max_len: int) -> DecodeGraphs:
        """Decode graphs captured against the current KV tensors (not installed: see capture_decode_graphs)."""
        graphs = DecodeGraphs(self.model, self.kv_caches, platform, self.block_size, self.scratch_block,
                              self.dropped_block, max_num_seqs, max_len)
        graphs.capture()
        return graphs

    @staticmethod
    def bytes_per_block(model, block_size: int) -> int:
        dtype = model.dtype
        tensors = 1 if model.latent_kv else 2  # (key and value, or one latent row)
        return tensors * model.num_layers * block_size * model.num_kv_heads * model.head_dim * dtype.itemsize

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_len: int, num_seqs: int) -> torch.Tensor:
        """The largest steps the scheduler can build, their K/V written to the scratch block: a prefill of
        num_tokens whose first sequence is a chunk after cached context, up to max_len (attention's largest
        temporaries: a chunked prefill's or a cached prefix's), the rest in sequences of at most max_len;
        then num_seqs decodes at max_len (the decode attention's). Returns the decode step's fp32 logits."""
        first = max(1, min(num_tokens, max_len - 1))
        rest = range(0, num_tokens - first, max_len)
        self._run_dummy([(first, max(first + 1, max_len))] + [(min(max_len, num_tokens - first - i),) * 2 for i in rest])
        return self.model.compute_logits(self._run_dummy([(1, max_len)] * num_seqs)).float()

    def _run_dummy(self, shapes: list[tuple[int, int]]) -> torch.Tensor:
        """Hidden states of a step of (new tokens, context) sequences reading and writing the scratch block."""
        shapes = sorted(shapes, key=lambda shape: shape[0] != 1)  # the kernels take decodes first
        if self.lora is not None:
            self.lora.layers.set_segments([], [])  # (the base model's)
        chunks = [SequenceChunk([0] * n, c - n, [self.scratch_block] * cdiv(c, self.block_size)) for n, c in shapes]
        return self.model(*self._prepare(chunks, [n for n, _ in shapes], [c for _, c in shapes]))

    @torch.inference_mode()
    def warm_up(self, num_tokens: int) -> torch.Tensor:
        """A prefill of num_tokens, then one decode step, all in the scratch block (its contents are
        garbage by design); returns the decode step's logits."""
        num_tokens = max(1, min(num_tokens, WARM_UP_TOKENS))
        table = [self.scratch_block] * (num_tokens // self.block_size + 1)
        self.execute([SequenceChunk([0] * num_tokens, 0, table)])
        return self.execute([SequenceChunk([0], num_tokens, table)]).logits

    @torch.inference_mode()
    def execute(self, chunks: list[SequenceChunk]) -> StepOutput:
        """Run one step: fp32 logits for the chunks that want them, and the prompt logprobs chunks ask for."""
        self._draft_sources = {}  # (the last step's hidden states go before this one's are made)
        # Kernels take decodes first (and each adapter's rows together: backend/models/lora.py); remember where each
        # chunk went.
        slots = self.lora.activate([c.lora for c in chunks]) if self.lora is not None else [-1] * len(chunks)
        order = sorted(range(len(chunks)), key=lambda i: (len(chunks[i].token_ids) != 1, slots[i]))
        ordered = [chunks[i] for i in order]
        query_lens = [len(c.token_ids) for c in ordered]
        if self.lora is not None:
            self.lora.layers.set_segments([slots[i] for i in order], query_lens)
        context_lens = [c.num_computed + len(c.token_ids) for c in ordered]
        # Only the last token of each sequence that wants logits reaches the lm_head.
        last = np.cumsum(query_lens) - 1
        where = {i: last[rank] for rank, i in enumerate(order)}
        rows = [where[i] - c.num_drafts for i, c in enumerate(chunks) if c.wants_logits]
        draft_rows = [int(row) for i, c in enumerate(chunks) if c.wants_logits
                      for row in range(where[i] - c.num_drafts + 1, where[i] + 1)]
        if self.decode_graphs is not None and self.decode_graphs.covers(query_lens, context_lens):
            with scope("forward"):
                hidden = self.decode_graphs.run([c.token_ids[0] for c in ordered], context_lens,
                                                [c.block_ids for c in ordered])
        else:
            with scope("prepare"):
                inputs = self._prepare(ordered, query_lens, context_lens)
            if self.encoder_cache is not None:
                with scope("encode"):
                    inputs = (*inputs, self._image_embeds(ordered, query_lens))
            with scope("forward"):
                hidden = self.model(*inputs)
        starts = {i: last[rank] + 1 - query_lens[rank] for rank, i in enumerate(order)}
        scored = [self._score_prompt(hidden, starts[i], c.prompt_scoring) if c.prompt_scoring else None
                  for i, c in enumerate(chunks)]
        drafting = self.model.draft_head is not None
        if drafting:  # (what the draft head reads of this step, kept on this rank for its pass)
            self._draft_sources = {"step": self.model.draft_inputs(hidden)}
        step = StepOutput(torch.empty(0, self.model.config.vocab_size, device=self.device), scored,
                          first_rows=[int(starts[i]) for i in range(len(chunks))] if drafting else None)
        if rows:
            with scope("forward"):
                logits = self.model.compute_logits(hidden[torch.tensor(rows + draft_rows, device=self.device)]).float()
            step.logits, step.draft_logits = logits[:len(rows)], logits[len(rows):]
        return step

    @torch.inference_mode()
    def draft(self, chunks: list[DraftChunk], source: str) -> list[int]:
        """The draft head's pass over the chunks (an MTP layer or an EAGLE head; its K/V land in its own cache
        layer): the drafted next token of each chunk that wants one (its argmax, as vLLM's proposers draft), in their
        order. chunks[i].hidden_rows index the hidden states this rank kept: source "step", those of the last
        execute; "draft", the head's own at the last pass's drafting chunks, in their order (what it reads as the
        target's when it drafts the token after, as vLLM recurses it). Made on every rank under tensor parallel."""
        hidden = self._draft_sources[source]
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].next_ids) != 1)  # (decodes first)
        ordered = [SequenceChunk(chunks[i].next_ids, chunks[i].num_computed, chunks[i].block_ids) for i in order]
        query_lens = [len(c.token_ids) for c in ordered]
        context_lens = [c.num_computed + len(c.token_ids) for c in ordered]
        with scope("draft"):
            next_ids, positions, kv_caches, metadata = self._prepare(ordered, query_lens, context_lens)
            target = hidden[torch.tensor([row for i in order for row in chunks[i].hidden_rows], device=self.device)]
            drafted = self.model.draft_hidden(next_ids, positions, target, kv_caches, metadata)
            last = np.cumsum(query_lens) - 1
            where = {i: int(last[rank]) for rank, i in enumerate(order)}
            rows = [where[i] for i, c in enumerate(chunks) if c.wants_draft]
            self._draft_sources["draft"] = drafted = drafted[torch.tensor(rows, dtype=torch.long, device=self.device)]
            return self.model.draft_tokens(drafted).tolist() if rows else []

    def add_lora(self, lora: LoRARequest) -> None:
        """Read the adapter into host memory now (ValueError naming what is wrong), so that a step never does."""
        self._lora_manager().add(lora)

    def remove_lora(self, lora_int_id: int) -> None:
        self._lora_manager().remove(lora_int_id)

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora")
        return self.lora

    def _score_prompt(self, hidden: torch.Tensor, start: int, scoring: PromptScoring) -> list[dict[int, Logprob]]:
        """The logprobs of the prompt tokens one chunk predicts, PROMPT_LOGPROBS_ROWS rows of logits at a time."""
        entries = []
        with scope("sample"):
            for first in range(0, len(scoring.targets), PROMPT_LOGPROBS_ROWS):
                targets = torch.tensor(scoring.targets[first : first + PROMPT_LOGPROBS_ROWS], device=self.device)
                begin = start + scoring.first_row + first
                logits = self.model.compute_logits(hidden[begin : begin + len(targets)]).float()
                entries += ranked_logprobs(logits, targets, [scoring.top] * len(targets))
        return entries

    def _image_embeds(self, ordered: list[SequenceChunk], query_lens: list[int]):
        """(rows of the step, their embeddings) for the image tokens the chunks run, or None: each image's embeddings
        from the encoder cache, or its encoder run now (a chunk may hold part of an image)."""
        rows, embeddings, first_row = [], [], 0
        for chunk, n in zip(ordered, query_lens):
            start, stop = chunk.num_computed, chunk.num_computed + n
            for image in chunk.images:
                encoded = self.encoder_cache.get(image.hash, lambda: self.model.encode_image(image.pixel_values,
                                                                                             image.grid_thw))
                first, last = max(start, image.offset), min(stop, image.offset + image.length)
                rows.append(torch.arange(first - start, last - start) + first_row)
                embeddings.append(encoded[first - image.offset : last - image.offset])
            first_row += n
        if not rows:
            return None
        return torch.cat(rows).to(self.device), torch.cat(embeddings)

    def _prepare(self, ordered: list[SequenceChunk], query_lens: list[int], context_lens: list[int]):
        """The model's arguments for one step: input ids, positions (M-RoPE's three streams [3, tokens] for a
        vision-language model), KV caches, attention metadata."""
        metadata = AttentionMetadata.build(
            query_lens, context_lens, [c.block_ids for c in ordered], self.block_size, self.device, self.dropped_block
        )
        input_ids = np.fromiter((t for c in ordered for t in c.token_ids), dtype=np.int64, count=sum(query_lens))
        spans = [(c.num_computed, c.num_computed + len(c.token_ids)) for c in ordered]
        if self.model.is_multimodal:
            positions = np.concatenate([c.positions if c.positions is not None else text_positions(*span)
                                        for c, span in zip(ordered, spans)], axis=1)
        else:
            positions = np.concatenate([np.arange(*span) for span in spans])
        return (
            torch.from_numpy(input_ids).to(self.device),
            torch.from_numpy(positions).to(self.device),
            self.kv_caches,
            metadata,
        )
