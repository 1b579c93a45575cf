"""Misbehaving reward functions for the reward-pool tests (module level, so spawned workers can import them)."""

import time


def hangs(sample, cfg):
    while True:
        time.sleep(0.01)


def raises(sample, cfg):
    raise KeyError("no such field")


def echo_length(sample, cfg):
    return float(len(sample.response))
