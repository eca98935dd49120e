"""Dependency parsing under a time budget (paper 004, the parsing experiment): the
arc-factored parser trained over random template states (:mod:`.parser`), the EWT reader
(:mod:`.data`), the template-assignment policies (:mod:`.policies`) and the bundle builder
(:mod:`.bundle`). The templates and the decoder live in ``service`` (the service computes
them and never imports ``training``)."""
