"""pksampler.train"""
