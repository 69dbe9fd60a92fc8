"""Models from other toolkits as lconv workdirs (``python -m lconv.import_fairseq``)."""
