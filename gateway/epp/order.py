"""The order ext_proc sends one HTTP exchange's messages in, in ``FULL_DUPLEX_STREAMED``
mode: each message kind is taken only in the phases listed, and moves the exchange to the
phase after it (a headers message or body that ends its side moves on; a body that does not
stays). Anything else closes the stream (``OutOfOrder``)."""

from __future__ import annotations

NEW, REQUEST, PROXIED, RESPONSE, ENDED = range(5)
_ALLOWED = {"request_headers": (NEW,), "request_body": (REQUEST,),
            "request_trailers": (REQUEST,), "response_headers": (PROXIED,),
            "response_body": (RESPONSE,), "response_trailers": (RESPONSE,)}


class OutOfOrder(Exception):
    """A message ext_proc does not send at this point of an exchange (a second headers
    message, a body after the end of its stream, a response before the request was
    proxied...): the stream is refused and closed, nothing is admitted again."""


def advance(phase: int, which: str | None, end: bool) -> int:
    """The phase after message ``which`` (``end``: it ends its side) in ``phase``; raises
    ``OutOfOrder`` when it may not come now."""
    if which not in _ALLOWED or phase not in _ALLOWED[which]:
        raise OutOfOrder(f"ext_proc message {which} out of order")
    if which == "request_headers":
        return PROXIED if end else REQUEST
    if which == "request_trailers" or (which == "request_body" and end):
        return PROXIED
    if which == "response_headers":
        return ENDED if end else RESPONSE
    if which == "response_trailers" or (which == "response_body" and end):
        return ENDED
    return phase
