"""amdxdna-direct: drive AMD XDNA NPUs through the Linux amdxdna ioctls, without XRT."""
