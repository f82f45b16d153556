"""Low-bit communication, one mechanism for every stage: blockwise codecs with stated error
bounds (:mod:`.codecs`), the public policy (:class:`LowBit`), error feedback, and the
collectives a wrapper sends through (:class:`LowBitWire`) with their byte counts, fallbacks
and shadow checks. The stages decide what a message is; this package decides how it travels."""

from .codecs import FORMATS, Codec, codec_for
from .feedback import ErrorFeedback, feed_from, feed_into, feedbacks_into
from .policy import MODES, LowBit, LowBitCheck
from .report import StepTraffic
from .wire import LowBitWire, Pending

__all__ = ["FORMATS", "Codec", "codec_for", "ErrorFeedback", "feed_from", "feed_into", "feedbacks_into", "MODES", "LowBit", "LowBitCheck", "StepTraffic", "LowBitWire", "Pending"]
