"""Money: dollars per 1,000 output tokens at a given traffic, for a fleet of identical machines (the
step-time model is servingplan.costmodel; this module is about dollars only)."""
from __future__ import annotations


def cost_per_1k_tokens(price_per_hour: float, replicas: int, output_tokens_per_s: float) -> float:
    """Every machine is paid for the whole hour, busy or not; the tokens are the traffic's."""
    if output_tokens_per_s <= 0:
        return float("inf")
    return price_per_hour * replicas / 3600.0 / output_tokens_per_s * 1000.0


def max_replicas_within(price_per_hour: float, output_tokens_per_s: float, target_per_1k: float) -> int:
    """The most machines the cost target allows at this traffic."""
    if price_per_hour <= 0:
        return 10**9
    return int(target_per_1k * output_tokens_per_s * 3600.0 / 1000.0 / price_per_hour)
