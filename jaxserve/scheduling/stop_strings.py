"""Stop strings over streamed text: cut at the first match, and hold back what could still become one.

Text arrives in pieces (a token's worth, or less while a multi-byte character is incomplete). A stop
string can span pieces, so the tail of the text that is a prefix of some stop string is held back until
the next piece settles it; at the end of the output whatever is held is emitted.
"""

from __future__ import annotations

from jaxserve.sampling.params import SamplingParams


def apply_stop_strings(out, params: SamplingParams, piece: str, final: bool) -> tuple[str, str | None]:
    """Append `piece` to `out` (an `OutputState`), cutting at the first stop string. Returns the text that
    became final and the stop string that matched (None: none did)."""
    stops = params.stop
    if not stops:
        out.pieces.append(piece)
        return piece, None
    pending = out.held + piece
    hits = [(pending.find(s), s) for s in stops if s in pending]
    matched = None
    if hits:
        cut, matched = min(hits)
        end = cut + len(matched) if params.include_stop_str_in_output else cut
        emitted, out.held = pending[:end], ""
    elif final:
        emitted, out.held = pending, ""
    else:
        keep = max(len(s) - 1 for s in stops)
        # Withhold only a suffix that could still grow into a stop string.
        hold = next((n for n in range(min(keep, len(pending)), 0, -1)
                     if any(s.startswith(pending[-n:]) for s in stops)), 0)
        emitted, out.held = pending[:len(pending) - hold], pending[len(pending) - hold:]
    out.pieces.append(emitted)
    return emitted, matched
