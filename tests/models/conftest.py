# model files the tests name with --model: loaded by hspmd, not collected by pytest
collect_ignore = ["data"]
