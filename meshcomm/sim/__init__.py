"""Exact in-process simulation of N ranks: shards, collectives and plan execution."""
from .shards import gather, scatter, take
