"""Tests of the service package: the HTTP API, the handler, bundles, caches, strategies."""
