"""Speculative-decoding algorithms: DDTree/chain builders, tree masks, the acceptance walk, token choice."""
