"""Offline long-context evaluation: tasks, scoring, equal-memory budgets, the runner and its report."""
