"""Speculative decoding: proposers draft tokens on the host or the device, the one ragged step verifies them.

1. Before a step is planned, the `Speculator` (`speculator.py`) asks its proposer for drafts for every
   running sequence that may speculate (its draw is known, and its sampling is exact per position) and
   leaves on `Request.draft_token_ids` as many as pay: `payoff.py` weighs each draft's chance of standing
   (`acceptance.py`) against what a drafting step costs over a plain one (`cost.py`); above
   `disable_by_batch_size` sequences nobody drafts.
2. The scheduler plans each draft as a token of the sequence's span (counted in the token budget) and the
   step program draws after each of them and keeps the longest prefix the target reproduces
   (`jaxserve/execution/draws.py`); `update_from_output` appends what stands and rolls back the rest.
3. Proposers: `ngram.py` (prompt lookup, on the host) and `draft_model.py` (a smaller model with its own
   KV pages and its own jitted program that drafts K tokens in one device call). `proposer.py` is their
   interface; docs/speculative.md says how an EAGLE-style head fits it.
"""
