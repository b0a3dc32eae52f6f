"""Exports of one analysed job: the JSON report and its schema, the HTML page, the Chrome trace,
the PyTorch memory snapshot."""
