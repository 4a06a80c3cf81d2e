"""pksampler.samplers"""
