"""Builders shared by the tests (named so that nothing clashes with the product's modules)."""
