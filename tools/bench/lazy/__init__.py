# SPDX-License-Identifier: Apache-2.0
"""Host memory of boosting a big model lazily (``LazyInitContext``) against eagerly."""
