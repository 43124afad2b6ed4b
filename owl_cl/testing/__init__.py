"""Helpers for tests (of this package and of code built on it): tiny fake datasets."""
