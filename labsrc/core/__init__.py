"""The ground every rank, lab and notebook stands on: rank context, run records, options, profiles, plans, progress,
GPU leases, forked ranks, widgets, exercise helpers, shared figures; it imports nothing outside core/."""
