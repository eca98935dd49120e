"""Bundle writers: the shared staging/version/provenance writer and one builder per bundle kind."""
