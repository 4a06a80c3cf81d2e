"""pksampler.datasets"""
