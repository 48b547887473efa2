"""Meshes, logical-axis rules (one table per role) and weight resharding.

Model parameters carry `logical_axes` metadata (see jaxrl_post.models.transformer); this
package maps those names to mesh axes, so model code never names a mesh.
"""
