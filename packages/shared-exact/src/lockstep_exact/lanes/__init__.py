"""Lanes: which byte program runs at each op site of a model family, and the composition.

Both engine plugins build their models from these functions, so the order of op sites and
the rounding points between them exist once.
"""
