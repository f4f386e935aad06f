"""STAR: decode-phase rescheduling for PD-disaggregated LLM serving."""

__version__ = "0.1.0"
