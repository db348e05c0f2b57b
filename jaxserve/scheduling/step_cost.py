"""Step-time model: what a planned step will cost on the device, learned from what steps did cost.

1. A step runs the compiled program of its token bucket (its decode and prefill tokens padded up to the
   bucket), so its time is a base time per bucket plus a term in the KV its attention reads (each
   sequence's context up to the end of its span): `seconds = base[bucket] + per_kv_token * kv_tokens`.
2. Warm-up times a few steps of each compiled bucket; afterwards the engine feeds in every step whose
   completion the host waited for (`StepClock` tells its device time from host timestamps), so the
   estimate follows the machine as it serves (load, clocks, long contexts). Each bucket keeps exponentially weighted sums of (kv, seconds); the KV slope is the
   within-bucket regression pooled over buckets, and a bucket's base is its mean time less the slope's
   share. An observation costs a few float operations, and a one-off stall (a GC pause) is clipped.
3. A bucket nobody has measured is interpolated from its measured neighbours (linear in tokens; above
   the largest measured one, proportional to tokens, which errs on the slow side). A bigger bucket is
   never faster than a smaller one, so a bucket's base is capped by every bigger bucket's: a timing
   that a busy machine slowed cannot make one bucket look slower than all those above it.
4. The scheduler asks `predict(tokens, kv_tokens)` while it fills a step that carries decodes, and stops
   adding prefill tokens where the prediction would pass its inter-token-latency target.
"""

from __future__ import annotations

import bisect
import dataclasses

from jaxserve.scheduling.step import StepPlan

# Weight of the past per new observation of the same bucket: about the last 20 steps of a bucket count.
FORGETTING = 0.95
# A measured step more than this many times its prediction updates the model as if it took that long.
CLIP = 2.0
# The derived inter-token-latency target: this many times a full batch's decode-only step.
DERIVED_TARGET_FACTOR = 2.0


@dataclasses.dataclass
class _BucketStats:
    """Exponentially weighted sums over one bucket's observations."""
    weight: float = 0.0
    kv: float = 0.0
    seconds: float = 0.0
    kv_kv: float = 0.0
    kv_seconds: float = 0.0

    def add(self, kv: float, seconds: float) -> None:
        for name in ("weight", "kv", "seconds", "kv_kv", "kv_seconds"):
            setattr(self, name, getattr(self, name) * FORGETTING)
        self.weight += 1
        self.kv += kv
        self.seconds += seconds
        self.kv_kv += kv * kv
        self.kv_seconds += kv * seconds

    @property
    def kv_variance(self) -> float:  # times the weight: pooled over buckets as a sum
        return self.kv_kv - self.kv * self.kv / self.weight

    @property
    def kv_covariance(self) -> float:
        return self.kv_seconds - self.kv * self.seconds / self.weight


class StepCostModel:
    def __init__(self, buckets: tuple[int, ...]):
        self.buckets = tuple(buckets)
        self._stats: dict[int, _BucketStats] = {}
        self.per_kv_token = 0.0  # seconds per KV token read
        self._measured: dict[int, float] = {}  # measured buckets' base seconds, as fitted
        self._base: dict[int, float] = {}  # every bucket's, monotone in the bucket (empty before a measurement)

    @property
    def calibrated(self) -> bool:
        """Whether some bucket has been measured (until then nothing is predicted)."""
        return bool(self._measured)

    def bucket_for(self, tokens: int) -> int:
        i = bisect.bisect_left(self.buckets, tokens)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def observe(self, bucket: int, kv_tokens: int, seconds: float) -> None:
        """A step padded to `bucket` tokens that read `kv_tokens` of KV took `seconds` on the device."""
        if seconds <= 0:
            return
        predicted = self.predict(bucket, kv_tokens) if bucket in self._measured else None
        if predicted is not None:
            seconds = min(seconds, CLIP * predicted)
        self._stats.setdefault(bucket, _BucketStats()).add(kv_tokens, seconds)
        self._refit()

    def _refit(self) -> None:
        variance = sum(s.kv_variance for s in self._stats.values())
        covariance = sum(s.kv_covariance for s in self._stats.values())
        # No spread in KV within a bucket (warm-up alone, one context length): no slope to tell apart.
        slope = covariance / variance if variance > 1.0 else 0.0
        self.per_kv_token = max(slope, 0.0)
        self._measured = {b: max((s.seconds - self.per_kv_token * s.kv) / s.weight, 0.0)
                          for b, s in self._stats.items()}
        base, cap = {}, float("inf")
        for bucket in reversed(self.buckets):
            cap = base[bucket] = min(self._interpolated(bucket), cap)
        self._base = base

    def _interpolated(self, bucket: int) -> float:
        """The bucket's fitted base, or one interpolated from the measured buckets around it."""
        measured = self._measured
        if bucket in measured:
            return measured[bucket]
        known = sorted(measured)
        i = bisect.bisect_left(known, bucket)
        if i == 0:
            return measured[known[0]]  # smaller steps are not slower than the smallest measured
        if i == len(known):
            return measured[known[-1]] * bucket / known[-1]
        lo, hi = known[i - 1], known[i]
        return measured[lo] + (measured[hi] - measured[lo]) * (bucket - lo) / (hi - lo)

    def base_seconds(self, bucket: int) -> float | None:
        """A step of `bucket` tokens reading no KV (None before any measurement)."""
        return self._base.get(bucket)

    def predict(self, tokens: int, kv_tokens: int) -> float | None:
        """Seconds a step of `tokens` tokens (padded to their bucket) reading `kv_tokens` of KV should take;
        None before any measurement."""
        base = self.base_seconds(self.bucket_for(tokens))
        return None if base is None else base + self.per_kv_token * kv_tokens

    def derived_target(self, max_num_seqs: int, context: float = 0.0) -> float | None:
        """The default inter-token-latency target: a multiple of a full batch's decode-only step, each
        sequence at `context` tokens of context (those decoding now), predicted as every step is, KV term
        included: a target without it stood below a prediction with it, and where the fitted slope was
        steep (5-8 us a KV token on stories260K at 4 streams, served) a 64-token prompt beside 3 decodes
        was prefilled 5 tokens a step. The full batch's bucket is often not served (4 streams of 16
        slots), so its base may still be warm-up's while the buckets served have slowed since (the HTTP
        thread shares the cores): the batch is taken as no faster than any smaller one is now."""
        base = self.full_batch_base(max_num_seqs)
        if base is None:
            return None
        return DERIVED_TARGET_FACTOR * (base + self.per_kv_token * max_num_seqs * context)

    def full_batch_base(self, max_num_seqs: int) -> float | None:
        """A full batch's decode step reading no KV: its bucket's fitted base, or a smaller bucket's where
        that one is measured slower now (None before any measurement)."""
        full = self.bucket_for(max_num_seqs)
        bases = [seconds for bucket, seconds in self._measured.items() if bucket <= full]
        return max(bases, default=self.base_seconds(full))


class PrefillCap:
    """How many prefill tokens a step that carries decodes may take under the ITL target, chunk by chunk:
    each chunk also adds the KV its tokens attend to. Whatever the model predicts, the step may grow to
    the bucket above the decodes' own, so waiting prompts always progress (with coarse buckets, the
    padding of the decodes' bucket alone could be a token a step) and a step at most about doubles."""

    def __init__(self, cost: StepCostModel, target: float, decode_tokens: int, decode_kv: int, limit: int):
        self.cost, self.target = cost, target
        self.tokens, self.kv = decode_tokens, decode_kv
        bucket = cost.bucket_for(cost.bucket_for(decode_tokens) + 1)
        self.free = max(min(bucket, limit) - decode_tokens, 0)  # prefill tokens allowed whatever the model says

    def fit(self, wanted: int, start: int) -> int:
        """The most of `wanted` tokens (a chunk from position `start`) predicted to fit; records them."""
        def fits(n: int) -> bool:
            return self.cost.predict(self.tokens + n, self.kv + start + n) <= self.target

        lo = min(wanted, self.free)
        if wanted > lo and fits(wanted):
            lo = wanted
        else:  # the largest n in [lo, wanted) that fits: predictions grow with n
            hi = wanted
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        self.free = max(self.free - lo, 0)
        self.tokens += lo
        self.kv += start + lo
        return lo



class StepClock:
    """A step's device time from what the host sees: when it launched the step and when the samples
    arrived. The host reads steps in launch order, one step late, so a step ran from its launch or from
    the end of the step before it, whichever came last, to the arrival of its samples. Both ends are known
    only when the host had to wait for the samples (else they arrived at some moment before it looked)."""

    def __init__(self):
        self._last: tuple[float, bool] | None = None  # the step before: (samples seen at, waited for)

    def device_seconds(self, launched_at: float, done_at: float, waited: bool) -> float | None:
        """This step's device seconds, or None where they cannot be told."""
        last, self._last = self._last, (done_at, waited)
        if not waited:
            return None
        start = launched_at
        if last is not None and last[0] > start:
            if not last[1]:
                return None  # the step before ended at some unknown moment before its samples were read
            start = last[0]
        return done_at - start


def kv_tokens_read(plan: StepPlan) -> int:
    """KV a step's attention reads: each sequence's context up to the end of its span."""
    return sum(seq.start + seq.num_tokens for seq in plan.seqs)
