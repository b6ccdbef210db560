"""Launch configuration of the RMSNorm kernels (cute-free)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RMSNormConfig:
    threads: int
    vec_per_thread: int  # 16-byte (8 x bf16) vectors per thread

    @classmethod
    def for_hidden(cls, hidden: int) -> "RMSNormConfig":
        """One CTA per row, one 16-byte vector per thread up to 1024 threads.

        Decode rows are few (M <= 8 per step): the kernel is latency-bound, so
        the widest CTA (shortest per-thread chain, one load in flight per
        thread) wins; hidden 2048 -> 256 threads, 2880 -> 384 (360 active),
        4096 -> 512. Beyond 8192 each thread takes several vectors.
        """
        vecs = hidden // 8
        threads = min(1024, -(-vecs // 32) * 32)
        return cls(threads=threads, vec_per_thread=-(-vecs // threads))
