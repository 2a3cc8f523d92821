"""Conformance suites and helpers that third-party stores and drivers can reuse."""
