"""TLT: lossless speculative-decoding rollouts for reasoning RL with an online-trained drafter."""

__version__ = "0.1.0"
