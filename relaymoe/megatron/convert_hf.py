"""placeholder"""


def add_parser(sub) -> None:
    sub.add_parser("convert-hf")


def main(ns) -> int:
    return 1
