from django.contrib import admin
from django.urls import path
from transfers import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("transfers", views.create_transfer),
    path("transfers/<int:pk>", views.show_transfer),
    path("metrics", views.metrics),
]
