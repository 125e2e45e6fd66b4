"""Reading finished results back, with no torch: collect.py gathers the rows of any results
directories into series, sweep.py turns a sweep into tables, plots and report.html (``python -m
harness.report DIR``), compare.py matches two result sets point by point (``python -m
harness.report.compare A B``), markdown.py writes the benchmark scripts' Markdown tables.
"""
