"""Ports of the KV policies' reference code (the authors' public repositories) to plain torch,
written for the tests from the cited files: each module restates one reference's scoring and
selection for a single sequence (batch 1, as the references run), and
``test_reference_ports.py`` compares the kept index sets of the library's policies with them.
Test code only; nothing in ``src`` imports it. A new eviction policy is expected to bring a
port of its reference here."""
