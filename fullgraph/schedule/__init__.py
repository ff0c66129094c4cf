"""Schedules as data: chunk ranges, memory budgets, and the orders steps run in."""
