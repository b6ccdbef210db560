"""Launch configuration of the RMSNorm kernels (cute-free)."""

from __future__ import annotations

from dataclasses import dataclass

# 16-byte vectors one thread holds over its rows (4 registers each): 8 rows of hidden 4096 at 512 threads
MAX_ROW_VECS = 8


@dataclass(frozen=True)
class RMSNormConfig:
    threads: int
    vec_per_thread: int  # 16-byte (8 x bf16) vectors per thread and row
    rows_per_cta: int = 1  # rows one CTA normalizes (grid ceil(M / rows_per_cta)); the rows' words stay in registers

    def __post_init__(self):
        for name in ("threads", "vec_per_thread", "rows_per_cta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"RMSNormConfig.{name} = {v!r}: must be a positive int")
        if self.threads % 32 or self.threads > 1024:
            raise ValueError(f"RMSNormConfig.threads = {self.threads}: must be a multiple of 32 up to 1024")
        if self.rows_per_cta * self.vec_per_thread > MAX_ROW_VECS:
            raise ValueError(f"RMSNormConfig.rows_per_cta = {self.rows_per_cta} with {self.vec_per_thread} vectors "
                             f"per thread holds {self.rows_per_cta * self.vec_per_thread} 16-byte vectors per thread "
                             f"(at most {MAX_ROW_VECS}: 4 registers each); take fewer rows per CTA")

    @classmethod
    def for_hidden(cls, hidden: int, max_rows: int = 1) -> "RMSNormConfig":
        """One CTA per row, one 16-byte vector per thread up to 1024 threads.

        Decode rows are few (M <= 8 per step): the kernel is latency-bound, so
        the widest CTA (shortest per-thread chain, one load in flight per
        thread) wins; hidden 2048 -> 256 threads, 2880 -> 384 (360 active),
        4096 -> 512. Beyond 8192 each thread takes several vectors.
        """
        vecs = hidden // 8
        threads = min(1024, -(-vecs // 32) * 32)
        vec_per_thread = -(-vecs // threads)
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows = {max_rows!r}: must be a positive int")
        # up to max_rows rows, fewer where a row takes several vectors per thread
        return cls(threads=threads, vec_per_thread=vec_per_thread,
                   rows_per_cta=max(1, min(max_rows, MAX_ROW_VECS // vec_per_thread)))
