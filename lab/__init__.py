"""The lab: what develops, demonstrates and measures Refinery, apart from the product.

A local Kafka broker (plain and secure), the cluster simulator and its ground truth, the demo,
``refinery verify`` (a lake against a simulator run's truth), the benchmark suite and lake
synthesis. The product (``schemas``, ``pipelines``, ``services``) never imports the lab; the
CLI entry point alone dispatches to it, lazily.
"""
